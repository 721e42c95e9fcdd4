//! Mutual TLS between the daemons and authorization by peer identity.
//!
//! Every daemon has one certificate, signed by the deployment's private CA
//! (`pdbridge certs`), which it serves and also presents when it dials a peer.
//! A certificate's *identity* is a DNS name in its subjectAltName
//! (`prefill-1`, `mac-1`): names, not host addresses, so a box can change its
//! IP without new certificates. A dialing daemon checks that the server it
//! reached holds the identity its config expects; a serving daemon lets any
//! certificate signed by the CA open a connection (health and reflection stay
//! usable by monitors without one), and each RPC's access rule says who may call it
//! (`layers::access`, which asks [`Peers::authenticated`] or [`Peers::authorized`]).

use std::{collections::BTreeSet, path::PathBuf, sync::Arc};

use serde::Deserialize;
use tokio_rustls::rustls::{
    self,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};
use tonic::{
    Code, Status,
    transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig},
};

use crate::config::{ConfigError, Validate};

/// `[tls]`: this daemon's certificate and the peers it trusts.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM certificate (chain) this daemon serves and presents as a client.
    pub cert: PathBuf,
    /// PEM private key of `cert`.
    pub key: PathBuf,
    /// PEM certificate of the CA that signs every peer's certificate.
    pub ca: PathBuf,
    /// Identities allowed to call this daemon's restricted RPCs (decoded:
    /// the prefillers that may Push, Lookup and read the bundle; prefilld:
    /// the decoders that may start a prefill).
    pub peers: Vec<String>,
}

impl Validate for TlsConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.peers.is_empty() {
            return Err(ConfigError::invalid("tls.peers", "list at least one peer identity"));
        }
        if let Some(bad) = self.peers.iter().find(|name| !is_identity(name)) {
            return Err(ConfigError::invalid("tls.peers", format!("{bad:?} is not a DNS-style name")));
        }
        for (key, path) in [("tls.cert", &self.cert), ("tls.key", &self.key), ("tls.ca", &self.ca)] {
            if !path.is_file() {
                return Err(ConfigError::invalid(key, format!("{} not found", path.display())));
            }
        }
        Ok(())
    }
}

/// Whether `name` can be a certificate identity: a DNS name of letters,
/// digits, hyphens and dots (what the CA issues and rustls verifies).
pub fn is_identity(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        })
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key} = {path}: {source}")]
    Read { key: &'static str, path: String, source: std::io::Error },
    #[error("tls.cert: {0}")]
    Certificate(String),
}

/// The loaded certificate material, ready for tonic's server and channels.
#[derive(Clone)]
pub struct Tls {
    identity: Identity,
    ca: Certificate,
    peers: Arc<BTreeSet<String>>,
    /// The PEM files, for listeners that are not gRPC (prefilld's stage listener).
    pem: Arc<Pem>,
    /// When the certificate this daemon serves stops being valid, in seconds since the epoch.
    expires_at: i64,
}

struct Pem {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
}

impl Tls {
    /// Reads the PEM files, and refuses a certificate with no identity.
    pub fn load(config: &TlsConfig) -> Result<Self, TlsError> {
        let read = |key: &'static str, path: &PathBuf| {
            std::fs::read(path).map_err(|source| TlsError::Read { key, path: path.display().to_string(), source })
        };
        let cert = read("tls.cert", &config.cert)?;
        let key = read("tls.key", &config.key)?;
        let ca = read("tls.ca", &config.ca)?;
        let leaf = first_pem_der(&cert).ok_or_else(|| TlsError::Certificate("no PEM certificate".into()))?;
        let parsed = parse(&leaf).map_err(TlsError::Certificate)?;
        if names_of(&parsed).map_err(TlsError::Certificate)?.is_empty() {
            return Err(TlsError::Certificate("the certificate names no DNS identity".into()));
        }
        let expires_at = parsed.validity().not_after.timestamp();
        Ok(Tls {
            identity: Identity::from_pem(&cert, &key),
            ca: Certificate::from_pem(&ca),
            peers: Arc::new(config.peers.iter().cloned().collect()),
            pem: Arc::new(Pem { cert, key, ca }),
            expires_at,
        })
    }

    /// When the certificate this daemon serves expires, in seconds since the epoch.
    pub fn expires_at(&self) -> i64 {
        self.expires_at
    }

    /// A rustls server that serves our certificate and admits only clients
    /// whose certificate chains to the CA (who they are is the caller's to
    /// check, with [`identities`] of the presented certificate).
    pub fn rustls_server(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let bad = |e: &dyn std::fmt::Display| TlsError::Certificate(e.to_string());
        let chain =
            CertificateDer::pem_slice_iter(&self.pem.cert).collect::<Result<Vec<_>, _>>().map_err(|e| bad(&e))?;
        let key = PrivateKeyDer::from_pem_slice(&self.pem.key).map_err(|e| bad(&e))?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(&self.pem.ca) {
            roots.add(ca.map_err(|e| bad(&e))?).map_err(|e| bad(&e))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| bad(&e))?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad(&e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| bad(&e))?;
        // No TLS 1.3 session tickets: a client that never reads (a stage only writes) would close
        // with them unread, which makes its kernel reset the connection, and a reset can drop the
        // last frames it sent before they are read here.
        config.send_tls13_tickets = 0;
        Ok(Arc::new(config))
    }

    /// Server side: our certificate; a client certificate, when offered, must
    /// chain to the CA (RPCs that need one check with [`Peers`]).
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .client_auth_optional(true)
    }

    /// Client side: present our certificate and accept only a server whose
    /// certificate chains to the CA and names `server_identity`.
    pub fn client(&self, server_identity: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .identity(self.identity.clone())
            .ca_certificate(self.ca.clone())
            .domain_name(server_identity)
    }

    /// Who may call this daemon's restricted RPCs.
    pub fn peers(&self) -> Peers {
        Peers { allowed: Some(self.peers.clone()) }
    }
}

/// An endpoint for `addr`: over mutual TLS when `tls` is given, accepting
/// only a server that holds `identity` (default: the URI's host).
pub fn endpoint(addr: &str, tls: Option<&Tls>, identity: Option<&str>) -> Result<Endpoint, String> {
    let endpoint = Endpoint::from_shared(addr.to_owned()).map_err(|e| format!("bad address {addr:?}: {e}"))?;
    let Some(tls) = tls else { return Ok(endpoint) };
    let host = endpoint.uri().host().unwrap_or_default().to_owned();
    endpoint.tls_config(tls.client(identity.unwrap_or(&host))).map_err(|e| format!("TLS for {addr}: {e}"))
}

/// The scheme a dialed address must use: `https://` with `[tls]`, `http://`
/// without (a mismatch would fail on the first call, far from the cause).
pub fn check_scheme(key: &str, addr: &str, tls: bool) -> Result<(), ConfigError> {
    let scheme = if tls { "https://" } else { "http://" };
    if addr.starts_with(scheme) {
        return Ok(());
    }
    let why = if tls { "with [tls]" } else { "without [tls]" };
    Err(ConfigError::invalid(key, format!("must start with {scheme} {why}, e.g. {scheme}host:port")))
}

/// Why a caller may not make an RPC.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("this RPC needs a client certificate signed by the deployment's CA")]
    NoCertificate,
    #[error("unreadable client certificate: {0}")]
    BadCertificate(String),
    #[error("peer {0} is not in this daemon's tls.peers")]
    NotAPeer(String),
}

impl AuthError {
    pub fn code(&self) -> Code {
        match self {
            AuthError::NoCertificate | AuthError::BadCertificate(_) => Code::Unauthenticated,
            AuthError::NotAPeer(_) => Code::PermissionDenied,
        }
    }
}

impl From<AuthError> for Status {
    fn from(e: AuthError) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

/// Authorization of one RPC by the caller's certificate. Without TLS (a
/// loopback-only or explicitly insecure deployment) every caller passes.
#[derive(Clone, Debug, Default)]
pub struct Peers {
    allowed: Option<Arc<BTreeSet<String>>>,
}

impl Peers {
    /// No TLS: anyone who can reach the port.
    pub fn open() -> Self {
        Peers { allowed: None }
    }

    /// The caller holds a certificate signed by the CA (any identity).
    pub fn authenticated(&self, certs: Option<&[CertificateDer<'_>]>) -> Result<Option<String>, AuthError> {
        if self.allowed.is_none() {
            return Ok(None);
        }
        let names = caller_identities(certs)?;
        Ok(names.into_iter().next())
    }

    /// The caller holds a certificate signed by the CA whose identity is one of
    /// `tls.peers`; returns that identity.
    pub fn authorized(&self, certs: Option<&[CertificateDer<'_>]>) -> Result<Option<String>, AuthError> {
        let Some(allowed) = &self.allowed else { return Ok(None) };
        let names = caller_identities(certs)?;
        match names.iter().find(|name| allowed.contains(*name)) {
            Some(name) => Ok(Some(name.clone())),
            None => Err(AuthError::NotAPeer(names.join(", "))),
        }
    }
}

/// The identities of the caller's verified certificate; UNAUTHENTICATED when
/// it presented none (rustls has already checked any it presented against
/// the CA).
fn caller_identities(certs: Option<&[CertificateDer<'_>]>) -> Result<Vec<String>, AuthError> {
    let certs = certs.filter(|certs| !certs.is_empty()).ok_or(AuthError::NoCertificate)?;
    identities(certs[0].as_ref()).map_err(AuthError::BadCertificate)
}

/// The DNS names in a DER certificate's subjectAltName.
pub fn identities(der: &[u8]) -> Result<Vec<String>, String> {
    names_of(&parse(der)?)
}

fn parse(der: &[u8]) -> Result<x509_parser::certificate::X509Certificate<'_>, String> {
    x509_parser::parse_x509_certificate(der).map(|(_, cert)| cert).map_err(|e| format!("unreadable certificate: {e}"))
}

fn names_of(cert: &x509_parser::certificate::X509Certificate<'_>) -> Result<Vec<String>, String> {
    let san = cert.subject_alternative_name().map_err(|e| format!("unreadable subjectAltName: {e}"))?;
    Ok(san
        .into_iter()
        .flat_map(|ext| ext.value.general_names.iter())
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => Some((*dns).to_owned()),
            _ => None,
        })
        .collect())
}

/// The DER bytes of the first certificate in a PEM file.
pub fn first_pem_der(pem: &[u8]) -> Option<Vec<u8>> {
    x509_parser::pem::Pem::iter_from_buffer(pem)
        .filter_map(Result::ok)
        .find(|pem| pem.label == "CERTIFICATE")
        .map(|pem| pem.contents)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_are_dns_style_names() {
        for good in ["prefill-1", "mac-1.lab", "a"] {
            assert!(is_identity(good), "{good}");
        }
        for bad in ["", "-x", "x-", "a..b", "a b", "../etc", "mac_1", &"x".repeat(64)] {
            assert!(!is_identity(bad), "{bad}");
        }
    }

    #[test]
    fn without_tls_every_caller_passes() {
        assert_eq!(Peers::open().authorized(None).unwrap(), None);
    }

    #[test]
    fn with_tls_a_caller_without_a_certificate_is_unauthenticated() {
        let peers = Peers { allowed: Some(Arc::new(["prefill-1".to_owned()].into())) };
        assert_eq!(peers.authorized(None).unwrap_err().code(), Code::Unauthenticated);
        assert_eq!(peers.authenticated(Some(&[])).unwrap_err().code(), Code::Unauthenticated);
    }
}
