//! TLS to PostgreSQL, chosen in the URL as libpq users know it: `sslmode=disable`,
//! `prefer`, `require`, `verify-ca` or `verify-full`, and `sslrootcert=FILE` (the PEM CA
//! that signed the server's certificate). Without `sslmode` a connection is not encrypted
//! (as before TLS existed here). `require` and `prefer` encrypt without checking who
//! answers, as in libpq; `require` with `sslrootcert` checks the chain like `verify-ca`;
//! `verify-full` also checks that the certificate names the host in the URL.
//!
//! The client library parses `sslmode` only up to `require`, so the URL it is given keeps
//! `sslmode=require` for every TLS mode, and the verification is this module's rustls
//! configuration.

use std::path::PathBuf;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

/// The TLS a URL asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PgTls {
    /// No `sslmode` given, or `sslmode=disable`: plain TCP.
    Off,
    /// `sslmode=prefer`: TLS if the server offers it, unverified; plain otherwise.
    Prefer,
    /// `sslmode=require` without `sslrootcert`: TLS, the server's certificate unverified.
    Require,
    /// `sslmode=verify-ca` (or `require` with `sslrootcert`): the chain must lead to the CA.
    VerifyCa(PathBuf),
    /// `sslmode=verify-full`: the chain must lead to the CA and name the URL's host.
    VerifyFull(PathBuf),
}

impl PgTls {
    /// The mode's name for the `database open` log line.
    pub fn name(&self) -> &'static str {
        match self {
            PgTls::Off => "off",
            PgTls::Prefer => "prefer",
            PgTls::Require => "require",
            PgTls::VerifyCa(_) => "verify-ca",
            PgTls::VerifyFull(_) => "verify-full",
        }
    }
}

/// Splits the TLS parameters out of `url`: the URL the client library is given (with
/// `sslrootcert` removed and `verify-*` as `require`) and the TLS to set up. Errors name the
/// parameter and what it accepts.
pub fn split_url(url: &str) -> Result<(String, PgTls), String> {
    let Some((base, query)) = url.split_once('?') else { return Ok((url.to_owned(), PgTls::Off)) };
    let mut mode: Option<String> = None;
    let mut root: Option<String> = None;
    let mut kept: Vec<&str> = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.split_once('=') {
            Some(("sslmode", v)) => mode = Some(v.to_owned()),
            Some(("sslrootcert", v)) => root = Some(percent_decode(v)),
            _ => kept.push(pair),
        }
    }
    let tls = match (mode.as_deref(), root) {
        (None | Some("disable"), None) => PgTls::Off,
        (Some("prefer"), None) => PgTls::Prefer,
        (Some("require"), None) => PgTls::Require,
        (Some("require" | "verify-ca"), Some(ca)) => PgTls::VerifyCa(PathBuf::from(ca)),
        (Some("verify-full"), Some(ca)) => PgTls::VerifyFull(PathBuf::from(ca)),
        (Some(m @ ("verify-ca" | "verify-full")), None) => {
            return Err(format!(
                "sslmode={m} needs sslrootcert=FILE: the PEM certificate of the CA that signed the server's"
            ));
        }
        (None | Some("disable" | "prefer"), Some(_)) => {
            return Err(
                "sslrootcert is given but sslmode does not verify: add sslmode=verify-full (or verify-ca)"
                    .into(),
            );
        }
        (Some(other), _) => {
            return Err(format!(
                "sslmode={other} is not a mode: give disable, prefer, require, verify-ca or verify-full"
            ));
        }
    };
    match &tls {
        PgTls::Off if mode.is_none() => {}
        PgTls::Off => kept.push("sslmode=disable"),
        PgTls::Prefer => kept.push("sslmode=prefer"),
        _ => kept.push("sslmode=require"),
    }
    let url = if kept.is_empty() { base.to_owned() } else { format!("{base}?{}", kept.join("&")) };
    Ok((url, tls))
}

/// `%XX` escapes decoded (a path in a URL may carry them); anything malformed stays as is.
fn percent_decode(v: &str) -> String {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                out.push(hi * 16 + lo);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The rustls configuration for `tls` (`None` for [`PgTls::Off`]), reading the CA file now
/// so that a missing or empty file stops the process at start-up, in one line.
pub fn client_config(tls: &PgTls) -> Result<Option<rustls::ClientConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS settings: {e}"))?;
    let config = match tls {
        PgTls::Off => return Ok(None),
        PgTls::Prefer | PgTls::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(
                provider.signature_verification_algorithms,
            )))
            .with_no_client_auth(),
        PgTls::VerifyFull(ca) => builder.with_root_certificates(roots(ca)?).with_no_client_auth(),
        PgTls::VerifyCa(ca) => {
            let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots(ca)?), provider)
                .build()
                .map_err(|e| format!("sslrootcert={}: {e}", ca.display()))?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(AnyName(inner)))
                .with_no_client_auth()
        }
    };
    Ok(Some(config))
}

fn roots(ca: &std::path::Path) -> Result<RootCertStore, String> {
    let shown = ca.display();
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(ca)
        .map_err(|e| format!("sslrootcert={shown}: cannot read it: {e}"))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("sslrootcert={shown}: not a PEM certificate file: {e}"))?;
    if certs.is_empty() {
        return Err(format!("sslrootcert={shown}: holds no PEM certificate"));
    }
    let mut store = RootCertStore::empty();
    let (added, ignored) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!("sslrootcert={shown}: none of its {ignored} certificates can be a trust anchor"));
    }
    Ok(store)
}

/// `require` and `prefer`: encrypts, accepts any certificate (libpq's meaning of the modes),
/// but still checks that the server holds the key of the certificate it showed.
#[derive(Debug)]
struct Unverified(WebPkiSupportedAlgorithms);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to the CA; the name in the certificate is not checked.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForNameContext {
                ..
            })) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_read_and_the_client_gets_what_it_parses() {
        let (u, t) = split_url("postgres://u@h/db").unwrap();
        assert_eq!((u.as_str(), t), ("postgres://u@h/db", PgTls::Off));
        let (u, t) = split_url("postgres://u@h/db?sslmode=disable&application_name=x").unwrap();
        assert_eq!((u.as_str(), t), ("postgres://u@h/db?application_name=x&sslmode=disable", PgTls::Off));
        let (u, t) = split_url("postgres://u@h/db?sslmode=require").unwrap();
        assert_eq!((u.as_str(), t), ("postgres://u@h/db?sslmode=require", PgTls::Require));
        let (u, t) = split_url("postgres://u@h/db?sslmode=verify-full&sslrootcert=/etc/ca%20x.pem").unwrap();
        assert_eq!(u, "postgres://u@h/db?sslmode=require");
        assert_eq!(t, PgTls::VerifyFull("/etc/ca x.pem".into()));
        let (_, t) = split_url("postgres://u@h/db?sslrootcert=ca.pem&sslmode=require").unwrap();
        assert_eq!(t, PgTls::VerifyCa("ca.pem".into()));
        assert_eq!(split_url("postgres://u@h/db?sslmode=prefer").unwrap().1, PgTls::Prefer);
    }

    #[test]
    fn bad_tls_parameters_say_what_is_accepted() {
        let e = split_url("postgres://u@h/db?sslmode=verify-full").unwrap_err();
        assert!(e.contains("needs sslrootcert=FILE"), "{e}");
        let e = split_url("postgres://u@h/db?sslmode=allow").unwrap_err();
        assert!(e.contains("sslmode=allow is not a mode") && e.contains("verify-full"), "{e}");
        let e = split_url("postgres://u@h/db?sslrootcert=x.pem").unwrap_err();
        assert!(e.contains("sslmode does not verify"), "{e}");
    }

    #[test]
    fn a_missing_or_empty_ca_file_is_refused_by_name() {
        let e = client_config(&PgTls::VerifyFull("/nonexistent/ca.pem".into())).unwrap_err();
        assert!(e.contains("sslrootcert=/nonexistent/ca.pem: cannot read it"), "{e}");
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "not a certificate\n").unwrap();
        let e = client_config(&PgTls::VerifyCa(empty.clone())).unwrap_err();
        assert!(e.contains("holds no PEM certificate"), "{e}");
        assert!(client_config(&PgTls::Off).unwrap().is_none());
        assert!(client_config(&PgTls::Require).unwrap().is_some());
    }
}
