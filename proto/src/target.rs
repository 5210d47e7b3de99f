//! Where a store lives: the value of `--db` (producer, consumer) and `--producer-db` (relay).
//! A `postgres://` or `postgresql://` URL selects the PostgreSQL backend; anything else is a
//! SQLite file path, the embedded default.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

/// A database argument, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DbTarget {
    /// A SQLite file (created by its owner on first start).
    Sqlite(PathBuf),
    /// A PostgreSQL server and database, as a libpq-style URL.
    Postgres(PgUrl),
}

/// A PostgreSQL connection URL, checked to parse, with its password kept out of `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct PgUrl {
    /// What the client library is given (the TLS parameters it does not know taken out).
    url: String,
    shown: String,
    tls: crate::pg_tls::PgTls,
}

impl PgUrl {
    /// The URL as the client library takes it (password included; the TLS parameters it does
    /// not parse taken out): pass it to the client, never to a log.
    pub fn as_secret_str(&self) -> &str {
        &self.url
    }

    /// The TLS the URL asks for (`sslmode`, `sslrootcert`).
    pub fn tls(&self) -> &crate::pg_tls::PgTls {
        &self.tls
    }

    /// The client configuration this URL describes.
    pub fn config(&self) -> tokio_postgres::Config {
        // Checked in `DbTarget::from_str`: a `PgUrl` exists only for a URL that parses.
        tokio_postgres::Config::from_str(&self.url).unwrap_or_default()
    }
}

impl fmt::Debug for PgUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

impl fmt::Display for PgUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.shown)
    }
}

/// True when `value` names a PostgreSQL database rather than a file.
pub fn is_postgres_url(value: &str) -> bool {
    value.starts_with("postgres://") || value.starts_with("postgresql://")
}

/// `value` with the password of a URL's user info replaced by `***`.
fn redact(value: &str) -> String {
    let Some((scheme, rest)) = value.split_once("://") else { return value.to_owned() };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => value.to_owned(),
        },
        None => value.to_owned(),
    }
}

impl FromStr for DbTarget {
    type Err = String;

    fn from_str(value: &str) -> Result<DbTarget, String> {
        if value.is_empty() {
            return Err("empty: give a file path or a postgres:// URL".into());
        }
        if is_postgres_url(value) {
            let shown = redact(value);
            let (url, tls) = crate::pg_tls::split_url(value).map_err(|e| format!("{shown}: {e}"))?;
            let config = tokio_postgres::Config::from_str(&url)
                .map_err(|e| format!("{shown}: not a PostgreSQL URL: {e}"))?;
            if config.get_dbname().is_none() {
                return Err(format!("{shown}: names no database (add /DBNAME to the URL)"));
            }
            return Ok(DbTarget::Postgres(PgUrl { url, shown, tls }));
        }
        Ok(DbTarget::Sqlite(PathBuf::from(value)))
    }
}

impl fmt::Display for DbTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DbTarget::Sqlite(path) => write!(f, "{}", path.display()),
            DbTarget::Postgres(url) => write!(f, "{url}"),
        }
    }
}

impl DbTarget {
    /// The backend's name for logs and reports: `sqlite` or `postgres`.
    pub fn backend(&self) -> &'static str {
        match self {
            DbTarget::Sqlite(_) => "sqlite",
            DbTarget::Postgres(_) => "postgres",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_urls_are_told_apart() {
        assert_eq!("p.db".parse::<DbTarget>(), Ok(DbTarget::Sqlite("p.db".into())));
        assert_eq!("/tmp/x/p.db".parse::<DbTarget>().map(|t| t.backend()), Ok("sqlite"));
        let pg: DbTarget = "postgres://postgres@127.0.0.1:5432/test".parse().unwrap();
        assert_eq!(pg.backend(), "postgres");
        assert_eq!(pg.to_string(), "postgres://postgres@127.0.0.1:5432/test");
        let pg: DbTarget = "postgresql://u:secret@h/db?sslmode=disable".parse().unwrap();
        assert_eq!(pg.to_string(), "postgresql://u:***@h/db?sslmode=disable");
        assert!(!format!("{pg:?}").contains("secret"));
        let DbTarget::Postgres(url) = pg else { panic!() };
        assert!(url.as_secret_str().contains("secret"));
        assert_eq!(url.config().get_dbname(), Some("db"));
    }

    #[test]
    fn bad_urls_are_refused_with_the_reason() {
        assert!("".parse::<DbTarget>().unwrap_err().contains("empty"));
        let e = "postgres://u@h".parse::<DbTarget>().unwrap_err();
        assert!(e.contains("names no database"), "{e}");
        let e = "postgres://u:pw@h:notaport/db".parse::<DbTarget>().unwrap_err();
        assert!(e.contains("not a PostgreSQL URL") && !e.contains("pw@"), "{e}");
    }
}
