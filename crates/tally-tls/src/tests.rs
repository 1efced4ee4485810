//! Handshakes between configs built from generated certificates: the cluster CA is
//! the only root, a certificate from another CA is refused, a certificate of the
//! cluster CA that names no node (or another node than the one dialed) is refused,
//! and a plaintext client fails the handshake without stopping the listener.

use super::refusals::Reason;
use super::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pem: String,
}

fn ca(name: &str) -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.distinguished_name.push(rcgen::DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().expect("key");
    let cert = params.self_signed(&key).expect("self-signed");
    Ca { pem: cert.pem(), issuer: Issuer::new(params, key) }
}

/// A node certificate for 127.0.0.1 and node id `name` signed by `ca`, written with
/// the CA into `dir`.
fn node_files(dir: &Path, name: &str, ca: &Ca) -> TlsConfig {
    cert_files(dir, name, &["127.0.0.1", "localhost", name], ca)
}

/// The nodes `a` and `b` of the tests' cluster, on no address.
fn ab() -> NodeNames {
    NodeNames::from([("a".to_string(), Vec::new()), ("b".to_string(), Vec::new())])
}

/// A certificate for `names` signed by `ca`, written with the CA into `dir`.
fn cert_files(dir: &Path, name: &str, names: &[&str], ca: &Ca) -> TlsConfig {
    let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    let params = CertificateParams::new(names).expect("params");
    let key = KeyPair::generate().expect("key");
    let cert = params.signed_by(&key, &ca.issuer).expect("signed");
    let write = |file: String, text: &str| {
        let path = dir.join(file);
        std::fs::write(&path, text).expect("write");
        path
    };
    TlsConfig {
        cert: write(format!("{name}.pem"), &cert.pem()),
        key: write(format!("{name}-key.pem"), &key.serialize_pem()),
        client_ca: None,
        cluster_ca: Some(write(format!("{name}-ca.pem"), &ca.pem)),
    }
}

/// Runs one handshake between `client` and `server` over a local socket and
/// exchanges a byte; returns the client's and the server's outcome. The client
/// expects node `b`'s certificate.
async fn handshake(client: TlsConnector, server: TlsAcceptor) -> (Result<(), String>, Result<(), String>) {
    handshake_named(client, server, |_| node_server_name("b").expect("name")).await
}

async fn handshake_named(
    client: TlsConnector,
    server: TlsAcceptor,
    name: impl FnOnce(SocketAddr) -> ServerName<'static>,
) -> (Result<(), String>, Result<(), String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let served = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.expect("accept");
        let mut tls = server.accept(tcp).await.map_err(|e| e.to_string())?;
        let mut byte = [0u8; 1];
        tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
        tls.write_all(&byte).await.map_err(|e| e.to_string())?;
        tls.flush().await.map_err(|e| e.to_string())
    });
    let dialed = async {
        let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
        let mut tls = client.connect(name(addr), tcp).await.map_err(|e| e.to_string())?;
        tls.write_all(b"x").await.map_err(|e| e.to_string())?;
        let mut byte = [0u8; 1];
        tls.read_exact(&mut byte).await.map_err(|e| e.to_string())?;
        Ok(())
    }
    .await;
    (dialed, served.await.expect("server task"))
}

#[tokio::test]
async fn nodes_of_one_ca_connect_and_a_node_of_another_ca_is_refused_both_ways() {
    let dir = tempfile_dir();
    let (ours, theirs) = (ca("cluster"), ca("elsewhere"));
    let a = ClusterTls::load(&node_files(dir.path(), "a", &ours), "a", ab()).expect("a");
    let b = ClusterTls::load(&node_files(dir.path(), "b", &ours), "b", ab()).expect("b");
    // A stranger trusts our CA but holds a certificate from another one (naming b).
    let mut stranger_files = node_files(dir.path(), "b", &theirs);
    stranger_files.cluster_ca = a.files().cluster_ca.clone();
    let stranger = ClusterTls::load(&stranger_files, "b", ab()).expect("stranger");

    let (client, server) = handshake(a.connector(), b.acceptor()).await;
    assert_eq!((client, server), (Ok(()), Ok(())));

    // Dialing in: the server refuses the stranger's client certificate.
    let (_, server) = handshake(stranger.connector(), b.acceptor()).await;
    let refused = server.expect_err("the stranger's certificate is refused");
    assert!(refused.contains("certificate"), "{refused}");

    // Being dialed: our client refuses the stranger's server certificate.
    let (client, _) = handshake(a.connector(), stranger.acceptor()).await;
    let refused = client.expect_err("the stranger's server certificate is refused");
    assert!(refused.contains("UnknownIssuer") || refused.contains("issuer"), "{refused}");
}

#[tokio::test]
async fn certificates_of_the_cluster_ca_open_node_links_only_for_the_node_they_name() {
    let dir = tempfile_dir();
    let ours = ca("cluster");
    let a = ClusterTls::load(&node_files(dir.path(), "a", &ours), "a", ab()).expect("a");
    let b = ClusterTls::load(&node_files(dir.path(), "b", &ours), "b", ab()).expect("b");
    // A client certificate the cluster CA signed, naming no node (127.0.0.1 only).
    let client = cert_files(dir.path(), "client", &["127.0.0.1"], &ours);
    let mine = NodeNames::from([("client".to_string(), Vec::new())]);
    assert!(matches!(ClusterTls::load(&client, "client", mine.clone()), Err(TlsError::NotThisNode { .. })));
    let client_tls =
        ClusterTls::load(&cert_files(dir.path(), "c2", &["127.0.0.1", "client"], &ours), "client", mine)
            .expect("a node of another cluster");
    let (_, server) = handshake(client_tls.connector(), b.acceptor()).await;
    let refused = server.expect_err("a certificate naming no node of the cluster is refused");
    assert!(refused.contains("NotValidForName") || refused.contains("name"), "{refused}");
    // The dialer expects the node it dials: a's certificate does not pass for b.
    let (client, _) = handshake(b.connector(), a.acceptor()).await;
    let refused = client.expect_err("a's certificate presented when b was dialed");
    assert!(refused.contains("NotValidForName") || refused.contains("name"), "{refused}");
    // What each side learns of the other.
    assert_eq!(handshake(a.connector(), b.acceptor()).await, (Ok(()), Ok(())));
    let chain = load_certs(&a.files().cert).expect("chain");
    assert_eq!(b.node_of(Some(&chain)), Some("a".to_string()));
    let ids: Vec<&str> = b.nodes().keys().map(String::as_str).collect();
    assert_eq!(ids, ["a", "b"]);
    assert!(matches!(node_server_name("has:colon"), Err(TlsError::NodeName(_))));
}

#[tokio::test]
async fn a_client_listener_with_a_client_ca_refuses_clients_without_a_certificate() {
    let dir = tempfile_dir();
    let ours = ca("cluster");
    let mut files = node_files(dir.path(), "a", &ours);
    let anyone = acceptor(&files).expect("acceptor");
    files.client_ca = files.cluster_ca.clone();
    let picky = acceptor(&files).expect("acceptor");
    // A client that trusts the CA but presents no certificate.
    let roots = load_roots(files.cluster_ca.as_deref().expect("ca")).expect("roots");
    let bare = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let bare = TlsConnector::from(Arc::new(bare));
    let by_ip = |addr: SocketAddr| server_name(addr);
    assert_eq!(handshake_named(bare.clone(), anyone, by_ip).await, (Ok(()), Ok(())));
    let (_, server) = handshake_named(bare, picky.clone(), by_ip).await;
    assert!(server.is_err(), "a client without a certificate was let in");
    let with_cert = ClusterTls::load(&files, "a", ab()).expect("cluster tls").connector();
    assert_eq!(handshake_named(with_cert, picky, by_ip).await, (Ok(()), Ok(())));
}

#[tokio::test]
async fn plaintext_and_silent_clients_are_refused_and_the_listener_goes_on() {
    let dir = tempfile_dir();
    let ours = ca("cluster");
    let tls = ClusterTls::load(&node_files(dir.path(), "a", &ours), "a", ab()).expect("tls");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let refused = |reason| refusals::get(Listener::Node, reason);
    let (failed_before, late_before) = (refused(Reason::TlsHandshake), refused(Reason::TlsTimeout));
    let mut incoming =
        TlsIncoming::start(listener, tls.acceptor(), Duration::from_millis(300), Listener::Node)
            .expect("incoming");
    assert_eq!(incoming.local_addr(), addr);
    // A silent client and a plaintext one: neither gets through, nor blocks others.
    let _silent = TcpStream::connect(addr).await.expect("connect");
    let mut plain = TcpStream::connect(addr).await.expect("connect");
    plain.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.expect("write");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the plaintext connection was not closed");
    assert!(!answer.starts_with(b"HTTP"), "a plaintext client got an HTTP answer");
    // A real client still gets in.
    let dial = async {
        let tcp = TcpStream::connect(addr).await.expect("connect");
        tls.connector().connect(node_server_name("a").expect("name"), tcp).await.expect("handshake")
    };
    let (_client, accepted) = tokio::join!(dial, incoming.next());
    assert!(accepted.is_some());
    // Each refusal is counted under its reason (no other test here starts a node
    // listener); the count follows the close the client saw, so it is waited for.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    for (reason, before, who) in [
        (Reason::TlsHandshake, failed_before, "the plaintext client"),
        (Reason::TlsTimeout, late_before, "the silent client"),
    ] {
        while refused(reason) == before && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(refused(reason) - before, 1, "{who}");
    }
}

#[test]
fn bad_files_are_clear_errors() {
    let dir = tempfile_dir();
    let missing = dir.path().join("missing.pem");
    assert!(matches!(load_certs(&missing), Err(TlsError::Read { .. })));
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").expect("write");
    assert!(matches!(load_certs(&junk), Err(TlsError::Pem { .. })));
    assert!(matches!(load_key(&junk), Err(TlsError::Pem { .. })));
    let files = TlsConfig { cert: junk.clone(), key: junk, client_ca: None, cluster_ca: None };
    assert_eq!(ClusterTls::load(&files, "a", ab()).err(), Some(TlsError::NoClusterCa));
    let empty = TlsConfig { cert: PathBuf::new(), ..files };
    assert_eq!(empty.validate(), Err(TlsError::EmptyPath("tls.cert")));
}

fn tempfile_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("temporary directory")
}
