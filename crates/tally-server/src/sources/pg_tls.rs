//! TLS for the PostgreSQL source: rustls behind tokio-postgres's TLS traits, and
//! libpq's `sslmode=verify-full` / `verify-ca` with `sslrootcert`, which
//! tokio-postgres's own parser does not know.
//!
//! A connection string's `sslmode` and `sslrootcert` are taken out of it
//! ([`TlsParams::split`], URL or key/value form) before tokio-postgres reads the
//! rest: `verify-full` checks the server's certificate against the CA file and the
//! host name (or IP) connected to, `verify-ca` the CA only; both send nothing in
//! clear (tokio-postgres is told `sslmode=require`). `disable` and no `sslmode`
//! connect in plaintext. `prefer` and `require` are refused: they encrypt without
//! checking who answers, so anyone on the path could read the query's answers and
//! the credentials.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};

/// How the source checks the server it connects to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PgTlsMode {
    /// The certificate chains to `sslrootcert` and names the host connected to.
    VerifyFull,
    /// The certificate chains to `sslrootcert`, whatever it names.
    VerifyCa,
}

/// What a connection string says about TLS, and the string without it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsParams {
    /// The connection string for tokio-postgres (`sslmode=require` when TLS is on).
    pub url: String,
    /// TLS, when `sslmode` asks for verification: the mode and the CA file.
    pub tls: Option<(PgTlsMode, PathBuf)>,
}

impl TlsParams {
    /// Takes `sslmode` and `sslrootcert` out of `url` (a `postgres://` URL or a
    /// key/value string); an error names what is wrong.
    pub fn split(url: &str) -> Result<Self, String> {
        let uri = url.starts_with("postgres://") || url.starts_with("postgresql://");
        let (head, params): (&str, Vec<&str>) = if uri {
            match url.split_once('?') {
                Some((head, query)) => (head, query.split('&').filter(|p| !p.is_empty()).collect()),
                None => (url, Vec::new()),
            }
        } else {
            ("", url.split_whitespace().collect())
        };
        let (mut mode, mut root, mut rest) = (None, None, Vec::new());
        for p in params {
            match p.split_once('=') {
                Some(("sslmode", v)) => mode = Some(v.to_string()),
                Some(("sslrootcert", v)) => {
                    root = Some(PathBuf::from(v.replace("%2F", "/").replace("%2f", "/")))
                }
                _ => rest.push(p),
            }
        }
        let tls = match mode.as_deref() {
            None | Some("disable") => None,
            Some(m @ ("verify-full" | "verify-ca")) => {
                let mode = if m == "verify-full" { PgTlsMode::VerifyFull } else { PgTlsMode::VerifyCa };
                let root = root.ok_or_else(|| {
                    format!(
                        "sslmode={m} needs sslrootcert=FILE: the CA the server's certificate must chain to"
                    )
                })?;
                rest.push("sslmode=require");
                Some((mode, root))
            }
            Some(m @ ("prefer" | "require" | "allow")) => {
                return Err(format!(
                    "sslmode={m} does not check who answers; use sslmode=verify-full with sslrootcert=FILE \
                     (or sslmode=disable on a link you trust)"
                ))
            }
            Some(other) => return Err(format!("unknown sslmode {other:?}")),
        };
        let url = if uri {
            if rest.is_empty() {
                head.to_string()
            } else {
                format!("{head}?{}", rest.join("&"))
            }
        } else {
            rest.join(" ")
        };
        Ok(Self { url, tls })
    }
}

/// tokio-postgres's TLS connector over a rustls client configuration.
#[derive(Clone)]
pub struct RustlsConnect(Arc<ClientConfig>);

impl RustlsConnect {
    /// The connector of `mode`, trusting only the CAs of `root`.
    pub fn new(mode: PgTlsMode, root: &std::path::Path) -> Result<Self, String> {
        let roots = Arc::new(tally_tls::load_roots(root).map_err(|e| e.to_string())?);
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let builder = ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let config = match mode {
            PgTlsMode::VerifyFull => builder.with_root_certificates(roots).with_no_client_auth(),
            PgTlsMode::VerifyCa => {
                let inner = WebPkiServerVerifier::builder_with_provider(roots, provider)
                    .build()
                    .map_err(|e| e.to_string())?;
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyName(inner)))
                    .with_no_client_auth()
            }
        };
        Ok(Self(Arc::new(config)))
    }
}

/// `verify-ca`: the chain is checked as for `verify-full`; a certificate that does
/// not name the host is let through.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
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

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTls<S>;
    type TlsConnect = RustlsConnectOne;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnectOne, Self::Error> {
        Ok(RustlsConnectOne { config: self.0.clone(), name: ServerName::try_from(domain.to_string())? })
    }
}

/// One connection's TLS handshake, to the host `name`.
pub struct RustlsConnectOne {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnectOne
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTls<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<PgTls<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let connector = tokio_rustls::TlsConnector::from(self.config);
            connector.connect(self.name, stream).await.map(PgTls)
        })
    }
}

/// A TLS stream to the PostgreSQL server.
pub struct PgTls<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for PgTls<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for PgTls<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for PgTls<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_are_taken_out_of_either_form() {
        let split = |url: &str| TlsParams::split(url);
        let full = split(
            "postgres://tally@db:5432/app?sslmode=verify-full&sslrootcert=/etc/ca.pem&connect_timeout=3",
        )
        .expect("valid");
        assert_eq!(full.url, "postgres://tally@db:5432/app?connect_timeout=3&sslmode=require");
        assert_eq!(full.tls, Some((PgTlsMode::VerifyFull, PathBuf::from("/etc/ca.pem"))));
        let kv = split("host=db user=tally sslmode=verify-ca sslrootcert=/etc/ca.pem").expect("valid");
        assert_eq!(kv.url, "host=db user=tally sslmode=require");
        assert_eq!(kv.tls, Some((PgTlsMode::VerifyCa, PathBuf::from("/etc/ca.pem"))));
        let plain = split("postgres://tally@127.0.0.1/app").expect("valid");
        assert_eq!((plain.url.as_str(), plain.tls), ("postgres://tally@127.0.0.1/app", None));
        assert_eq!(split("host=db sslmode=disable").expect("valid").tls, None);
        for bad in [
            "postgres://db/app?sslmode=verify-full",
            "postgres://db/app?sslmode=require",
            "host=db sslmode=prefer",
            "host=db sslmode=sometimes",
        ] {
            assert!(split(bad).is_err(), "{bad}");
        }
        for ok in [
            "postgres://tally@db:5432/app?connect_timeout=3&sslmode=require",
            "host=db user=tally sslmode=require",
        ] {
            ok.parse::<tokio_postgres::Config>().expect("tokio-postgres reads what is left");
        }
    }
}
