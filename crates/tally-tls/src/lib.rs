//! TLS for Tally's listeners and for the links between nodes, on rustls.
//!
//! One config section ([`TlsConfig`], `[tls]` in a node config) names PEM files:
//! this node's certificate chain and key, optionally a CA whose certificates clients
//! must present (`client_ca`), and the cluster CA (`cluster_ca`) that is the only
//! root trusted between nodes. From it come:
//!
//! | function | used by | what it verifies |
//! | --- | --- | --- |
//! | [`acceptor`] / [`stream_acceptor`] | client listeners (HTTP / RESP) | clients' certificates against `client_ca` when set, none otherwise |
//! | [`ClusterTls::load`] → [`ClusterTls::acceptor`] | node-to-node and raft listeners | every client presents a certificate signed by `cluster_ca` that names a node of the cluster (its node id as a DNS name) |
//! | [`ClusterTls::load`] → [`ClusterTls::client_config`] / [`ClusterTls::connector`] | node-to-node dials, raft RPCs | the server's certificate is signed by `cluster_ca` and names the node dialed ([`node_server_name`]) |
//!
//! [`TlsIncoming`] accepts TCP connections and runs their handshakes in their own
//! tasks, each bounded by a timeout, so one silent or plaintext client can neither
//! stall the listener nor hold a task forever; a refused handshake is logged.
//!
//! Two modules serve every listener of a node, TLS or not: [`admission`] decides
//! who keeps a connection when a listener is full, and [`refusals`] counts (and logs
//! within a budget) what listeners refuse.
//!
//! # Layout
//!
//! * `lib.rs` — [`TlsConfig`], the acceptors, [`ClusterTls`] and [`TlsIncoming`].
//! * [`admission`] — who keeps a connection when a listener is full.
//! * [`refusals`] — what listeners refused, counted by listener and reason.
//! * `tests.rs` — handshakes between configs built from generated certificates.
//!
//! Files are read when a node starts, not when its config is validated: a config is
//! checked on machines where the certificates do not exist yet.
//!
//! This crate never decides who may do what: it only proves who is at the other end.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
pub use tokio_rustls::server::TlsStream;
pub use tokio_rustls::{TlsAcceptor, TlsConnector};

pub mod admission;
pub mod refusals;
pub use admission::{Admission, Slot};
pub use refusals::Listener;

/// Most certificates read from one PEM file: a chain or a CA bundle is a handful;
/// this bounds what a wrong file (a whole system bundle, a log) can make a node hold.
pub const PEM_CERTS_MAX: usize = 64;
/// Largest PEM file read, in bytes.
pub const PEM_FILE_BYTES_MAX: u64 = 1 << 20;
/// Handshakes a [`TlsIncoming`] runs at once; more connections wait in the kernel's
/// backlog, so a flood of silent clients costs at most this many tasks.
pub const HANDSHAKES_IN_FLIGHT_MAX: usize = 256;
/// Accepted and handshaken connections a [`TlsIncoming`] holds before its owner
/// takes them.
pub const ACCEPTED_QUEUE_MAX: usize = 64;
/// How long [`TlsIncoming`] pauses after an accept error (for example out of file
/// descriptors), in milliseconds, so it does not spin.
pub const ACCEPT_BACKOFF_MS: u64 = 100;

/// The `[tls]` section of a node config: PEM files, read at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// This node's certificate chain (leaf first), presented on every listener
    /// and, between nodes, as the client certificate.
    pub cert: PathBuf,
    /// The private key of `cert` (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When set, clients of the client listeners (HTTP, RESP) must present a
    /// certificate signed by one of these CAs; when absent any client may connect.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca: Option<PathBuf>,
    /// The cluster CA: the only root trusted on node-to-node sessions and raft RPCs,
    /// in both directions. Required when the cluster has more than one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_ca: Option<PathBuf>,
}

impl TlsConfig {
    /// Checks what can be checked without the files: no path is empty.
    pub fn validate(&self) -> Result<(), TlsError> {
        let paths = [("tls.cert", Some(&self.cert)), ("tls.key", Some(&self.key))];
        let optional =
            [("tls.client_ca", self.client_ca.as_ref()), ("tls.cluster_ca", self.cluster_ca.as_ref())];
        for (field, path) in paths.into_iter().chain(optional) {
            if path.is_some_and(|p| p.as_os_str().is_empty()) {
                return Err(TlsError::EmptyPath(field));
            }
        }
        Ok(())
    }
}

/// Why TLS could not be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// A path in the config is empty.
    #[error("{0} must not be empty")]
    EmptyPath(&'static str),
    /// A file could not be read.
    #[error("cannot read {path}: {reason}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A file holds no usable PEM item of the kind expected.
    #[error("{path}: {reason}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The node-to-node links need `tls.cluster_ca`.
    #[error("tls.cluster_ca is required for TLS between nodes")]
    NoClusterCa,
    /// A node id that cannot be a certificate's DNS name, which TLS between nodes
    /// binds each node's certificate to.
    #[error(
        "node id {0:?} cannot be named by a certificate: with TLS between nodes, node ids must be DNS \
         names (letters, digits, '-' and '.')"
    )]
    NodeName(String),
    /// This node's certificate does not name this node's id.
    #[error(
        "{path}: the certificate does not name node {node:?}: with TLS between nodes, each node's \
         certificate carries its node id as a DNS subject alternative name (scripts/tls-local-ca.sh \
         adds it)"
    )]
    NotThisNode {
        /// The certificate file.
        path: PathBuf,
        /// This node's id.
        node: String,
    },
    /// rustls refused the certificates or the key (for example a key that does not
    /// match the certificate).
    #[error("TLS setup: {0}")]
    Rustls(String),
}

fn read_pem(path: &Path) -> Result<Vec<u8>, TlsError> {
    let read = |reason: String| TlsError::Read { path: path.to_path_buf(), reason };
    let meta = std::fs::metadata(path).map_err(|e| read(e.to_string()))?;
    if meta.len() > PEM_FILE_BYTES_MAX {
        return Err(read(format!("{} bytes, more than the limit of {PEM_FILE_BYTES_MAX}", meta.len())));
    }
    std::fs::read(path).map_err(|e| read(e.to_string()))
}

/// The certificates of the PEM file at `path`, in order (at least one, at most
/// [`PEM_CERTS_MAX`]).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_err = |reason: String| TlsError::Pem { path: path.to_path_buf(), reason };
    let bytes = read_pem(path)?;
    let mut certs = Vec::new();
    for cert in CertificateDer::pem_slice_iter(&bytes) {
        if certs.len() == PEM_CERTS_MAX {
            return Err(pem_err(format!("more than {PEM_CERTS_MAX} certificates")));
        }
        certs.push(cert.map_err(|e| pem_err(e.to_string()))?);
    }
    if certs.is_empty() {
        return Err(pem_err("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The private key of the PEM file at `path`.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read_pem(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
        path: path.to_path_buf(),
        reason: format!("no usable private key: {e}"),
    })
}

/// The CAs of the PEM file at `path` as a root store.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots.add(cert).map_err(|e| TlsError::Pem {
            path: path.to_path_buf(),
            reason: format!("not a usable CA: {e}"),
        })?;
    }
    Ok(roots)
}

/// The crypto provider every config here is built with, named rather than taken
/// from the process default so two providers linked in never make a build panic.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn rustls_err(e: rustls::Error) -> TlsError {
    TlsError::Rustls(e.to_string())
}

fn server_config(cfg: &TlsConfig, client_roots: Option<&Path>) -> Result<ServerConfig, TlsError> {
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(rustls_err)?;
    let builder = match client_roots {
        Some(path) => {
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(load_roots(path)?), provider())
                    .build()
                    .map_err(|e| TlsError::Rustls(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    builder.with_single_cert(load_certs(&cfg.cert)?, load_key(&cfg.key)?).map_err(rustls_err)
}

/// The acceptor of a client listener (HTTP, RESP): presents `cfg.cert`; when
/// `cfg.client_ca` is set, a client without a certificate signed by it is refused
/// in the handshake. HTTP/1.1 is the only protocol offered by ALPN.
pub fn acceptor(cfg: &TlsConfig) -> Result<TlsAcceptor, TlsError> {
    let mut config = server_config(cfg, cfg.client_ca.as_deref())?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The acceptor of a client listener that is not HTTP (RESP): as [`acceptor`], with
/// no ALPN protocol offered (Redis clients offer none, and one that offers some is
/// not refused for it).
pub fn stream_acceptor(cfg: &TlsConfig) -> Result<TlsAcceptor, TlsError> {
    Ok(TlsAcceptor::from(Arc::new(server_config(cfg, cfg.client_ca.as_deref())?)))
}

/// The cluster's nodes as TLS knows them: each node id (which its certificate
/// must name, as a DNS name) and the addresses it listens on, its raft address
/// first (raft RPCs name the node in their URLs and resolve it to that address).
pub type NodeNames = std::collections::BTreeMap<String, Vec<SocketAddr>>;

/// Mutual TLS between nodes: the cluster CA is the only root, both ways, and every
/// node's certificate names its node id (a DNS subject alternative name equal to
/// the id), checked in the handshake: a dialer accepts only the certificate of the
/// node it dials, a node listener only a certificate that names a node of the
/// cluster. A certificate the cluster CA signed for anything else (a client, a
/// service, a node of another cluster) opens nothing between nodes.
#[derive(Clone)]
pub struct ClusterTls {
    files: TlsConfig,
    nodes: Arc<NodeNames>,
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

/// The name a node's certificate must carry: its id, as a DNS name (`node1`).
pub fn node_server_name(id: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(id.to_string()).map_err(|_| TlsError::NodeName(id.to_string()))
}

/// Which of `nodes` the end-entity certificate `cert` names, if any.
fn node_named<'n>(cert: &CertificateDer<'_>, nodes: &'n NodeNames) -> Option<&'n str> {
    let cert = webpki::EndEntityCert::try_from(cert).ok()?;
    nodes.keys().map(String::as_str).find(|id| {
        node_server_name(id).is_ok_and(|name| cert.verify_is_valid_for_subject_name(&name).is_ok())
    })
}

/// The verifier of a node listener: the client certificate must chain to the
/// cluster CA (rustls's own verifier) and name a node of the cluster.
#[derive(Debug)]
struct NodeClientVerifier {
    inner: Arc<dyn rustls::server::danger::ClientCertVerifier>,
    nodes: Arc<NodeNames>,
}

impl rustls::server::danger::ClientCertVerifier for NodeClientVerifier {
    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::server::danger::ClientCertVerified, rustls::Error> {
        let verified = self.inner.verify_client_cert(end_entity, intermediates, now)?;
        match node_named(end_entity, &self.nodes) {
            Some(_) => Ok(verified),
            None => Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterTls").field("files", &self.files).finish_non_exhaustive()
    }
}

/// Two settings are equal when they were loaded from the same files.
impl PartialEq for ClusterTls {
    fn eq(&self, other: &Self) -> bool {
        self.files == other.files
    }
}

impl Eq for ClusterTls {}

impl ClusterTls {
    /// Reads the files of `cfg` (which must name `cluster_ca`) for a cluster of
    /// `nodes`; `me`'s own certificate must name it.
    pub fn load(cfg: &TlsConfig, me: &str, nodes: NodeNames) -> Result<Self, TlsError> {
        cfg.validate()?;
        for id in nodes.keys() {
            node_server_name(id)?;
        }
        let nodes = Arc::new(nodes);
        let ca = cfg.cluster_ca.as_deref().ok_or(TlsError::NoClusterCa)?;
        let certs = load_certs(&cfg.cert)?;
        let mine = std::collections::BTreeMap::from([(me.to_string(), Vec::new())]);
        if certs.first().and_then(|leaf| node_named(leaf, &mine)).is_none() {
            return Err(TlsError::NotThisNode { path: cfg.cert.clone(), node: me.to_string() });
        }
        let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(load_roots(ca)?), provider())
            .build()
            .map_err(|e| TlsError::Rustls(e.to_string()))?;
        let verifier = Arc::new(NodeClientVerifier { inner, nodes: nodes.clone() });
        let server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_err)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), load_key(&cfg.key)?)
            .map_err(rustls_err)?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(rustls_err)?
            .with_root_certificates(load_roots(ca)?)
            .with_client_auth_cert(certs, load_key(&cfg.key)?)
            .map_err(rustls_err)?;
        Ok(Self { files: cfg.clone(), nodes, server: Arc::new(server), client: Arc::new(client) })
    }

    /// The cluster's nodes, by id, with their addresses.
    pub fn nodes(&self) -> &NodeNames {
        &self.nodes
    }

    /// The node listening on `addr`, if the cluster has one there.
    pub fn node_at(&self, addr: SocketAddr) -> Option<&str> {
        self.nodes.iter().find(|(_, addrs)| addrs.contains(&addr)).map(|(id, _)| id.as_str())
    }

    /// The node a peer's certificate chain (leaf first, as a TLS session reports
    /// it) names: a node listener let it in only if it names one.
    pub fn node_of(&self, chain: Option<&[CertificateDer<'_>]>) -> Option<String> {
        chain.and_then(|c| c.first()).and_then(|leaf| node_named(leaf, &self.nodes)).map(str::to_string)
    }

    /// The files it was loaded from.
    pub fn files(&self) -> &TlsConfig {
        &self.files
    }

    /// The acceptor of a node-to-node or raft listener: refuses any client without
    /// a certificate signed by the cluster CA.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(Arc::clone(&self.server))
    }

    /// The client side: trusts only the cluster CA and presents this node's
    /// certificate. For clients that take a rustls config (reqwest).
    pub fn client_config(&self) -> ClientConfig {
        (*self.client).clone()
    }

    /// The client side as a Tokio connector.
    pub fn connector(&self) -> TlsConnector {
        TlsConnector::from(Arc::clone(&self.client))
    }
}

/// The name a client checks a client listener's certificate against when it dials
/// an address: its IP (the certificate lists it as an IP SAN). Between nodes the
/// name is the node id ([`node_server_name`]).
pub fn server_name(addr: SocketAddr) -> ServerName<'static> {
    ServerName::IpAddress(addr.ip().into())
}

/// Logs and counts a TLS handshake that `what` refused from `peer`.
pub fn refused_handshake(what: Listener, peer: SocketAddr, error: &std::io::Error) {
    refusals::count(what, refusals::Reason::TlsHandshake);
    refusals::log_limited(
        || tracing::warn!(target: refusals::AUDIT_TARGET, %peer, outcome = "refused", reason = "tls_handshake", %error, listener = what.as_str(), "{}: refused a connection: TLS handshake failed", what.describe()),
    );
}

/// Logs and counts a connection to `what` from `peer` that did not complete its TLS
/// handshake within `timeout`.
pub fn timed_out_handshake(what: Listener, peer: SocketAddr, timeout: Duration) {
    refusals::count(what, refusals::Reason::TlsTimeout);
    refusals::log_limited(|| {
        tracing::warn!(
            target: refusals::AUDIT_TARGET, %peer, outcome = "refused", reason = "tls_timeout", listener = what.as_str(), timeout_ms = timeout.as_millis() as u64,
            "{}: refused a connection: no TLS handshake in time", what.describe()
        )
    });
}

/// Connections accepted on a listener whose TLS handshakes succeeded.
///
/// A task accepts TCP connections and runs each handshake in its own task, at
/// most [`HANDSHAKES_IN_FLIGHT_MAX`] at once, each within `handshake_timeout`. A
/// failed or timed-out handshake (a plaintext client, a certificate from another
/// CA) closes the connection and is logged at `warn` with the peer and the reason;
/// the listener goes on. Dropping the `TlsIncoming` stops the task and closes the
/// listener.
pub struct TlsIncoming {
    local: SocketAddr,
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsIncoming {
    /// Starts accepting on `listener`; `what` names it in logs and in the refusal
    /// counts ([`refusals`]).
    pub fn start(
        listener: TcpListener,
        acceptor: TlsAcceptor,
        handshake_timeout: Duration,
        what: Listener,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let (tx, accepted) = mpsc::channel(ACCEPTED_QUEUE_MAX);
        let permits = Arc::new(Semaphore::new(HANDSHAKES_IN_FLIGHT_MAX));
        let task = tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else { return };
                let (stream, peer) = tokio::select! {
                    _ = tx.closed() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::warn!(%local, error = %e, "{}: accept failed; backing off", what.describe());
                            tokio::time::sleep(Duration::from_millis(ACCEPT_BACKOFF_MS)).await;
                            continue;
                        }
                    },
                };
                let _ = stream.set_nodelay(true);
                let (acceptor, tx) = (acceptor.clone(), tx.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => refused_handshake(what, peer, &e),
                        Err(_) => timed_out_handshake(what, peer, handshake_timeout),
                    }
                });
            }
        });
        Ok(Self { local, accepted, task })
    }

    /// The next connection whose handshake succeeded; `None` once the accept task
    /// has stopped.
    pub async fn next(&mut self) -> Option<(TlsStream<TcpStream>, SocketAddr)> {
        self.accepted.recv().await
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for TlsIncoming {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests;
