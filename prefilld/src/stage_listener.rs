//! The stage listener: pipeline stages on other boxes (`engine.nodes`) stream
//! their part of every block here, over mutual TLS, in the plugin socket's
//! frames; a stage may also fetch the decoder's reconstruction bundle.
//!
//! Only a client whose certificate chains to the deployment's CA and names
//! one of `engine.nodes.stage_peers` gets past the handshake and the identity
//! check; anyone else is logged and dropped before a byte of theirs is read.
//! Frames then go through the same [`Router`] as the unix socket's, with the
//! same bounds.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use pdbridge_common::{
    metric,
    tls::{self, Tls, TlsError},
};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tokio_util::sync::CancellationToken;

use crate::{capture::Router, config::NodesConfig};

/// Longest a TLS handshake may take: a peer that stalls it holds a task, not the listener.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Debug, thiserror::Error)]
pub enum StageListenerError {
    #[error("engine.nodes.stage_listen = {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    #[error("engine.nodes needs [tls]: {0}")]
    Tls(#[from] TlsError),
}

/// A bound stage listener, ready to serve.
pub struct StageListener {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    peers: Arc<[String]>,
    bundle_dir: PathBuf,
}

impl StageListener {
    pub async fn bind(nodes: &NodesConfig, tls: &Tls, bundle_dir: PathBuf) -> Result<Self, StageListenerError> {
        let acceptor = TlsAcceptor::from(tls.rustls_server()?);
        let listener =
            TcpListener::bind(nodes.stage_listen).await.map_err(|e| StageListenerError::Bind(nodes.stage_listen, e))?;
        Ok(StageListener { listener, acceptor, peers: nodes.stage_peers.clone().into(), bundle_dir })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves stages until `stop`, each connection on its own task.
    pub async fn serve(self, router: Arc<Router>, stop: CancellationToken) {
        let this = Arc::new(self);
        loop {
            let (tcp, addr) = tokio::select! {
                _ = stop.cancelled() => return,
                accepted = this.listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        tracing::warn!(error = %e, "stage listener: accept failed");
                        continue;
                    }
                },
            };
            let (this, router) = (this.clone(), router.clone());
            tokio::spawn(async move {
                let stream = match this.admit(tcp).await {
                    // Counted before logged: whoever reads the log line finds the count.
                    Ok((stream, peer)) => {
                        metrics::counter!(metric::STAGE_CONNECTIONS.name, "outcome" => "admitted").increment(1);
                        tracing::debug!(%addr, peer, "stage connected");
                        stream
                    }
                    Err(why) => {
                        metrics::counter!(metric::STAGE_CONNECTIONS.name, "outcome" => "refused").increment(1);
                        tracing::warn!(%addr, why, "stage listener: a connection refused");
                        return;
                    }
                };
                if let Err(e) = router.relay(stream, &this.bundle_dir).await {
                    tracing::warn!(%addr, error = %e, "stage connection failed");
                }
            });
        }
    }

    /// The TLS handshake (a CA-signed client certificate required), then the
    /// identity check; returns the stream and the peer's identity.
    async fn admit(&self, tcp: TcpStream) -> Result<(TlsStream<TcpStream>, String), String> {
        let _ = tcp.set_nodelay(true);
        let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(tcp));
        let stream = handshake.await.map_err(|_| "TLS handshake timed out".to_owned())?.map_err(|e| e.to_string())?;
        let (_, session) = stream.get_ref();
        let leaf = session.peer_certificates().and_then(|certs| certs.first()).ok_or("no client certificate")?;
        let names = tls::identities(leaf.as_ref())?;
        match names.iter().find(|name| self.peers.contains(name)) {
            Some(peer) => Ok((stream, peer.clone())),
            None => Err(format!("{} not in engine.nodes.stage_peers", names.join(", "))),
        }
    }
}
