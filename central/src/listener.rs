//! The API listener both APIs are mounted on (`/v1/sync` and the
//! reservation API): plain on loopback or mTLS (rustls, ring), the
//! identity a client certificate names, the local CA that `tenantgate
//! certs` makes, and the cap on requests in progress each API starts from.
//! Plumbing beneath both APIs: it imports neither.
//!
//! # Identity
//! A node's certificate must be signed by the configured client CA
//! (`--client-ca`), and names the node with one URI SAN
//!
//! ```text
//!     spiffe://<trust domain>/tenantgate/node/<node id>
//!     spiffe://<trust domain>/tenantgate/region/<region>/node/<node id>
//! ```
//!
//! (`<node id>` is Envoy's `node.id`, which the filter reports as
//! `node_id`). A certificate with no such SAN names the node by its subject
//! CN (and no region). A request whose `node_id` (or `region`, when the
//! certificate names one) differs is refused `403` and counted
//! (`tenantgate_sync_requests_total{result="forbidden"}`). A client with no
//! certificate, or one the CA did not sign, fails the TLS handshake.
//!
//! # Accepting
//! Handshakes run in tasks of their own (at most [`MAX_HANDSHAKES`] at once,
//! each within [`HANDSHAKE_TIMEOUT`]), so a slow or hostile client never
//! holds up the accept loop.
//!
//! Every accepted connection (plain or TLS, on each of serve's listeners:
//! sync and reservation API, gRPC, admin) gets TCP_NODELAY before its first
//! byte: tokio, hyper and axum leave Nagle's algorithm on, and an answer
//! written in two segments (a gRPC frame's header, then its body; an RLS
//! answer over about 250 bytes) then waits for the client's delayed ACK, about
//! 40 ms, twice Envoy's default ratelimit timeout.
//!
//! Each listener is served by `crate::bounded::serve`, under its caps on
//! connections, streams, message sizes and bytes in flight.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::IncomingStream;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Semaphore};
use tracing::{debug, warn};

/// Requests in progress at once, per API (`/v1/sync` and the reservation
/// API each count their own), unless `--max-in-flight` says otherwise.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 64;

/// Who a request comes from, as authenticated by the transport (client
/// certificate) or a bearer token.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    pub node_id: String,
    /// The region the identity names, if any.
    pub region: Option<String>,
}

/// Handshakes in progress at once.
pub const MAX_HANDSHAKES: usize = 256;
/// The longest a TLS handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The URI SAN path that names a node (see the module header).
const SAN_PATH: &str = "/tenantgate/";

/// The files of the sync listener's mTLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The service's certificate chain (PEM).
    pub cert: PathBuf,
    /// The service's private key (PEM).
    pub key: PathBuf,
    /// The CA that signs the nodes' certificates (PEM).
    pub client_ca: PathBuf,
}

/// What the sync handler knows of its client.
#[derive(Debug, Clone)]
pub struct Peer {
    pub addr: SocketAddr,
    /// Whether it came over TLS (with a certificate the CA signed).
    pub tls: bool,
    /// The identity its certificate names (`None`: no TLS, or a
    /// certificate that names no node, which is refused).
    pub identity: Option<Identity>,
}

impl Connected<IncomingStream<'_, SyncListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, SyncListener>) -> Peer {
        stream.remote_addr().clone()
    }
}

/// A connection of the sync listener, plain or TLS.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Io for T {}

/// The sync listener: plain TCP, or TLS with client certificates.
pub struct SyncListener {
    local: SocketAddr,
    kind: Kind,
}

enum Kind {
    Plain(TcpListener),
    Tls(mpsc::Receiver<(Box<dyn Io>, Peer)>),
}

fn io_error(what: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(what.to_string())
}

fn read_certs(path: &Path) -> std::io::Result<Vec<CertificateDer<'static>>> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| io_error(format!("{}: {e}", path.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| io_error(format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(io_error(format!("{}: no certificate", path.display())));
    }
    Ok(certs)
}

/// The rustls configuration of the sync listener.
pub fn server_config(files: &TlsFiles) -> std::io::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in read_certs(&files.client_ca)? {
        roots
            .add(ca)
            .map_err(|e| io_error(format!("{}: {e}", files.client_ca.display())))?;
    }
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| io_error(format!("{}: {e}", files.client_ca.display())))?;
    let certs = read_certs(&files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| io_error(format!("{}: {e}", files.key.display())))?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(io_error)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .map_err(|e| io_error(format!("{}: {e}", files.cert.display())))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The identity a (verified) client certificate names.
pub fn identity_of(cert: &[u8]) -> Option<Identity> {
    let (_, x509) = x509_parser::parse_x509_certificate(cert).ok()?;
    if let Ok(Some(san)) = x509.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::URI(uri) = name {
                if let Some(id) = identity_of_uri(uri) {
                    return Some(id);
                }
            }
        }
    }
    let cn = x509.subject().iter_common_name().next()?.as_str().ok()?;
    (!cn.is_empty()).then(|| Identity {
        node_id: cn.to_owned(),
        region: None,
    })
}

/// `spiffe://<domain>/tenantgate/[region/<r>/]node/<id>`.
pub fn identity_of_uri(uri: &str) -> Option<Identity> {
    let rest = uri.strip_prefix("spiffe://")?;
    let (_, path) = rest.split_once(SAN_PATH)?;
    let (region, node) = match path.strip_prefix("region/") {
        Some(r) => {
            let (region, node) = r.split_once('/')?;
            (Some(region.to_owned()), node)
        }
        None => (None, path),
    };
    let id = node.strip_prefix("node/")?;
    (!id.is_empty() && !id.contains('/')).then(|| Identity {
        node_id: id.to_owned(),
        region: region.filter(|r| !r.is_empty()),
    })
}

/// The URI SAN that names `node` (and `region`) in trust domain `domain`.
pub fn identity_uri(domain: &str, node: &str, region: Option<&str>) -> String {
    match region {
        Some(r) => format!("spiffe://{domain}{SAN_PATH}region/{r}/node/{node}"),
        None => format!("spiffe://{domain}{SAN_PATH}node/{node}"),
    }
}

impl SyncListener {
    pub fn plain(listener: TcpListener) -> SyncListener {
        let local = listener
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)));
        SyncListener {
            local,
            kind: Kind::Plain(listener),
        }
    }

    /// TLS with client certificates: accepts and handshakes in a task of
    /// its own (ended when the listener is dropped).
    pub fn tls(listener: TcpListener, files: &TlsFiles) -> std::io::Result<SyncListener> {
        SyncListener::tls_alpn(listener, files, b"http/1.1")
    }

    /// [`SyncListener::tls`] negotiating `alpn` (`h2` for the gRPC listener).
    pub fn tls_alpn(listener: TcpListener, files: &TlsFiles, alpn: &[u8]) -> std::io::Result<SyncListener> {
        let local = listener.local_addr()?;
        let mut config = server_config(files)?;
        config.alpn_protocols = vec![alpn.to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let (tx, rx) = mpsc::channel::<(Box<dyn Io>, Peer)>(64);
        tokio::spawn(accept_tls(listener, acceptor, tx));
        Ok(SyncListener {
            local,
            kind: Kind::Tls(rx),
        })
    }
}

async fn accept_tls(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    tx: mpsc::Sender<(Box<dyn Io>, Peer)>,
) {
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        if tx.is_closed() {
            return;
        }
        let Ok(permit) = handshakes.clone().acquire_owned().await else {
            return;
        };
        let (tcp, addr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "sync listener: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        no_delay(&tcp, addr);
        let acceptor = acceptor.clone();
        let tx = tx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let identity = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .and_then(|c| identity_of(c.as_ref()));
                    let peer = Peer {
                        addr,
                        tls: true,
                        identity,
                    };
                    let _ = tx.send((Box::new(stream) as Box<dyn Io>, peer)).await;
                }
                Ok(Err(e)) => debug!(%addr, error = %e, "sync listener: TLS handshake refused"),
                Err(_) => debug!(%addr, "sync listener: TLS handshake timed out"),
            }
        });
    }
}

/// Turns Nagle's algorithm off on an accepted connection (see the module
/// header); a socket that refuses is served anyway, and logged.
fn no_delay(tcp: &tokio::net::TcpStream, addr: SocketAddr) {
    if let Err(e) = tcp.set_nodelay(true) {
        debug!(%addr, error = %e, "cannot set TCP_NODELAY");
    }
}

impl axum::serve::Listener for SyncListener {
    type Io = Box<dyn Io>;
    type Addr = Peer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match &mut self.kind {
                Kind::Plain(l) => {
                    let (tcp, addr) = axum::serve::Listener::accept(l).await;
                    no_delay(&tcp, addr);
                    return (
                        Box::new(tcp) as Box<dyn Io>,
                        Peer {
                            addr,
                            tls: false,
                            identity: None,
                        },
                    );
                }
                Kind::Tls(rx) => match rx.recv().await {
                    Some(conn) => return conn,
                    // The acceptor ended (it cannot, while we hold rx).
                    None => std::future::pending::<()>().await,
                },
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Peer> {
        Ok(Peer {
            addr: self.local,
            tls: matches!(self.kind, Kind::Tls(_)),
            identity: None,
        })
    }
}

/// How long `tenantgate certs init`'s CA is valid: 10 years (3,650 days).
pub const CA_VALIDITY_DAYS: i64 = 3650;
/// How long the service's and the nodes' certificates are valid: 1 year
/// (365 days); reissue them with `tenantgate certs node` (and `certs init
/// --force` for a new CA) before then.
pub const CERT_VALIDITY_DAYS: i64 = 365;
/// Certificates are valid from this long before they are made, so a node
/// whose clock is a little behind accepts them.
const NOT_BEFORE_SKEW: time::Duration = time::Duration::hours(1);

/// Sets `p`'s validity: from now (less [`NOT_BEFORE_SKEW`]) for `days`.
fn valid_for(p: &mut rcgen::CertificateParams, days: i64) {
    let now = time::OffsetDateTime::now_utc();
    p.not_before = now.saturating_sub(NOT_BEFORE_SKEW);
    p.not_after = now.saturating_add(time::Duration::days(days));
}

/// The files `tenantgate certs init` writes.
#[derive(Debug, Clone)]
pub struct Issued {
    pub files: Vec<PathBuf>,
}

fn write(path: &Path, text: &str, secret: bool) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    #[cfg(not(unix))]
    let _ = secret;
    Ok(())
}

fn rc(e: rcgen::Error) -> String {
    e.to_string()
}

fn ca_params(name: &str) -> rcgen::CertificateParams {
    let mut p = rcgen::CertificateParams::default();
    p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    p.distinguished_name.push(rcgen::DnType::CommonName, name);
    p.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
        rcgen::KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn load_ca(dir: &Path) -> Result<(rcgen::CertificateParams, rcgen::KeyPair), String> {
    let key_path = dir.join("ca.key");
    let key_pem = std::fs::read_to_string(&key_path).map_err(|e| format!("{}: {e}", key_path.display()))?;
    let key = rcgen::KeyPair::from_pem(&key_pem).map_err(rc)?;
    Ok((ca_params("tenantgate local CA"), key))
}

/// `tenantgate certs init`: a local CA (`ca.pem`, `ca.key`) and the
/// service's certificate (`service.pem`, `service.key`) for `hosts` (DNS
/// names or IP addresses), in `dir`.
pub fn init_ca(dir: &Path, hosts: &[String]) -> Result<Issued, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let ca_key = rcgen::KeyPair::generate().map_err(rc)?;
    let mut params = ca_params("tenantgate local CA");
    valid_for(&mut params, CA_VALIDITY_DAYS);
    let ca = params.self_signed(&ca_key).map_err(rc)?;
    let mut files = Vec::new();
    for (name, text, secret) in [
        ("ca.pem", ca.pem(), false),
        ("ca.key", ca_key.serialize_pem(), true),
    ] {
        let path = dir.join(name);
        write(&path, &text, secret)?;
        files.push(path);
    }
    let mut service = rcgen::CertificateParams::new(hosts.to_vec()).map_err(rc)?;
    service
        .distinguished_name
        .push(rcgen::DnType::CommonName, "tenantgate serve");
    service.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    files.extend(issue(dir, "service", service)?);
    Ok(Issued { files })
}

/// `tenantgate certs node`: a node's certificate (`<node>.pem`,
/// `<node>.key`) naming `node` (and `region`), signed by the CA in `dir`.
pub fn issue_node(dir: &Path, domain: &str, node: &str, region: Option<&str>) -> Result<Issued, String> {
    if node.is_empty() || node.contains('/') || region.is_some_and(|r| r.is_empty() || r.contains('/')) {
        return Err(format!(
            "node id {node:?} and region must be non-empty and have no '/'"
        ));
    }
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name.push(rcgen::DnType::CommonName, node);
    let uri = rcgen::string::Ia5String::try_from(identity_uri(domain, node, region)).map_err(rc)?;
    p.subject_alt_names = vec![rcgen::SanType::URI(uri)];
    p.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    Ok(Issued {
        files: issue(dir, node, p)?,
    })
}

fn issue(dir: &Path, name: &str, mut params: rcgen::CertificateParams) -> Result<Vec<PathBuf>, String> {
    valid_for(&mut params, CERT_VALIDITY_DAYS);
    let (ca_params, ca_key) = load_ca(dir)?;
    let issuer = rcgen::Issuer::new(ca_params, &ca_key);
    let key = rcgen::KeyPair::generate().map_err(rc)?;
    let cert = params.signed_by(&key, &issuer).map_err(rc)?;
    let cert_path = dir.join(format!("{name}.pem"));
    let key_path = dir.join(format!("{name}.key"));
    write(&cert_path, &cert.pem(), false)?;
    write(&key_path, &key.serialize_pem(), true)?;
    Ok(vec![cert_path, key_path])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_san_names_the_node_and_maybe_its_region() {
        let id = identity_of_uri(&identity_uri("example.org", "envoy-1", Some("eu"))).unwrap();
        assert_eq!(
            (id.node_id.as_str(), id.region.as_deref()),
            ("envoy-1", Some("eu"))
        );
        let id = identity_of_uri("spiffe://td/tenantgate/node/n2").unwrap();
        assert_eq!((id.node_id.as_str(), id.region), ("n2", None));
        for bad in [
            "spiffe://td/ns/default/sa/x",
            "spiffe://td/tenantgate/node/",
            "https://td/tenantgate/node/x",
            "spiffe://td/tenantgate/node/a/b",
        ] {
            assert_eq!(identity_of_uri(bad), None, "{bad}");
        }
    }

    #[test]
    fn a_certificate_that_names_no_node_has_no_identity() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(identity_of(cert.der()), None);
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name.push(rcgen::DnType::CommonName, "envoy-7");
        let cert = p.self_signed(&key).unwrap();
        assert_eq!(
            identity_of(cert.der()).map(|i| i.node_id),
            Some("envoy-7".to_owned())
        );
    }

    #[test]
    fn certs_from_the_shipped_command_name_their_node() {
        let dir = tempfile::tempdir().unwrap();
        init_ca(dir.path(), &["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        issue_node(dir.path(), "tenantgate.local", "envoy-1", Some("eu")).unwrap();
        let pem = dir.path().join("envoy-1.pem");
        let der = read_certs(&pem).unwrap();
        let id = identity_of(der[0].as_ref()).unwrap();
        assert_eq!(id.node_id, "envoy-1");
        assert_eq!(id.region.as_deref(), Some("eu"));
        server_config(&TlsFiles {
            cert: dir.path().join("service.pem"),
            key: dir.path().join("service.key"),
            client_ca: dir.path().join("ca.pem"),
        })
        .unwrap();
    }

    #[test]
    fn the_ca_is_valid_ten_years_and_what_it_issues_one() {
        let dir = tempfile::tempdir().unwrap();
        init_ca(dir.path(), &["localhost".to_owned()]).unwrap();
        issue_node(dir.path(), "tenantgate.local", "envoy-1", None).unwrap();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        for (file, days) in [
            ("ca.pem", CA_VALIDITY_DAYS),
            ("service.pem", CERT_VALIDITY_DAYS),
            ("envoy-1.pem", CERT_VALIDITY_DAYS),
        ] {
            let der = read_certs(&dir.path().join(file)).unwrap();
            let (_, cert) = x509_parser::parse_x509_certificate(der[0].as_ref()).unwrap();
            let v = cert.validity();
            assert!(v.not_before.timestamp() <= now, "{file}: valid from now");
            let ends = v.not_after.timestamp() - now;
            assert!(
                (days * 86_400 - 60..=days * 86_400).contains(&ends),
                "{file}: {ends} s left"
            );
        }
    }
}
