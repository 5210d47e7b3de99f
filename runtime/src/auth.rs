//! Optional bearer-token authentication: the token is read from a file, sent by clients as
//! `authorization: Bearer <token>`, and compared in constant time. A refused call is
//! `UNAUTHENTICATED` and reaches no handler, so it changes nothing.

use std::path::Path;
use std::sync::Arc;

use subtle::ConstantTimeEq as _;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Longest token accepted from a file.
pub const MAX_TOKEN_BYTES: usize = 4096;

/// Why a token file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file cannot be read.
    #[error("token file {path}: {source}")]
    Read {
        /// The token file.
        path: String,
        /// Why reading failed.
        source: std::io::Error,
    },
    /// The content is not a usable token.
    #[error("token file {path}: {what}")]
    Invalid {
        /// The token file.
        path: String,
        /// What is wrong with its content.
        what: &'static str,
    },
}

/// Reads a token file: its content without the trailing newline; 1..=4096 bytes of
/// printable ASCII (so it fits an HTTP header).
pub fn read_token(path: &Path) -> Result<Arc<str>, TokenError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| TokenError::Read { path: shown.clone(), source })?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.is_empty() {
        return Err(TokenError::Invalid { path: shown, what: "is empty" });
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(TokenError::Invalid { path: shown, what: "holds more than 4096 bytes" });
    }
    if !token.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(TokenError::Invalid { path: shown, what: "must be printable ASCII without spaces" });
    }
    Ok(Arc::from(token))
}

/// Server side: refuses calls without the right bearer token. With no token configured,
/// every call passes.
#[derive(Clone, Debug, Default)]
pub struct RequireToken {
    expected: Option<Arc<str>>,
}

impl RequireToken {
    /// Requires `token` (or nothing, when `None`).
    pub fn new(token: Option<Arc<str>>) -> RequireToken {
        RequireToken { expected: token }
    }
}

impl Interceptor for RequireToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else { return Ok(request) };
        let presented = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .unwrap_or("");
        // Constant time over the token's bytes; a length mismatch is refused the same way.
        if bool::from(presented.as_bytes().ct_eq(expected.as_bytes())) {
            Ok(request)
        } else {
            Err(Status::unauthenticated("missing or wrong bearer token (authorization: Bearer <token>)"))
        }
    }
}

/// The token of an `authorization` value `Bearer <token>`. The scheme name is
/// case-insensitive (RFC 9110 §11.1): `bearer`, `BEARER` and `Bearer` are the same scheme.
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim_start_matches(' '))
}

/// Client side: adds `authorization: Bearer <token>` to every call (nothing when `None`).
#[derive(Clone, Debug, Default)]
pub struct SendToken {
    header: Option<MetadataValue<tonic::metadata::Ascii>>,
}

impl SendToken {
    /// Sends `token` (checked printable ASCII by [`read_token`]).
    pub fn new(token: Option<&str>) -> SendToken {
        SendToken { header: token.and_then(|t| format!("Bearer {t}").parse().ok()) }
    }
}

impl Interceptor for SendToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(header) = &self.header {
            request.metadata_mut().insert("authorization", header.clone());
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(expected: Option<&str>, presented: Option<&str>) -> bool {
        let mut server = RequireToken::new(expected.map(Arc::from));
        let mut client = SendToken::new(presented);
        let request = client.call(Request::new(())).expect("client side never fails");
        server.call(request).is_ok()
    }

    #[test]
    fn tokens() {
        assert!(check(None, None));
        assert!(check(None, Some("x")));
        assert!(check(Some("s3cret"), Some("s3cret")));
        assert!(!check(Some("s3cret"), None));
        assert!(!check(Some("s3cret"), Some("s3cre")));
        assert!(!check(Some("s3cret"), Some("s3cret!")));
        assert!(!check(Some("s3cret"), Some("S3cret")));
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_the_token_is_not() {
        let call = |value: &str| {
            let mut server = RequireToken::new(Some(Arc::from("s3cret")));
            let mut request = Request::new(());
            request.metadata_mut().insert("authorization", value.parse().unwrap());
            server.call(request).is_ok()
        };
        assert!(call("Bearer s3cret"));
        assert!(call("bearer s3cret"));
        assert!(call("BEARER s3cret"));
        assert!(call("bEaReR s3cret"));
        assert!(!call("bearer S3CRET"));
        assert!(!call("Basic s3cret"));
        assert!(!call("Bearers3cret"));
        assert!(!call("s3cret"));
    }

    #[test]
    fn token_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "abc\n").unwrap();
        assert_eq!(&*read_token(&path).unwrap(), "abc");
        std::fs::write(&path, "\n").unwrap();
        assert!(read_token(&path).unwrap_err().to_string().contains("is empty"));
        std::fs::write(&path, "a b").unwrap();
        assert!(read_token(&path).is_err());
        assert!(read_token(&dir.path().join("missing")).is_err());
    }
}
