//! HTTP/1 serving for a listener clients reach (the front door): what `axum::serve` leaves
//! unbounded — how long a client may take to send a request's headers (also on an idle kept-alive
//! connection, which waits for the next request's headers), and how many connections one peer
//! address may hold — bounded, with graceful draining on shutdown.

use std::{
    collections::HashMap,
    future::Future,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::Router;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
    service::TowerToHyperService,
};
use tokio::net::TcpListener;

use crate::metric;

/// The bounds of one listener.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// A request's headers must have arrived this long after the connection (or its previous
    /// answer) became ready for them; the connection is closed otherwise.
    pub header_read_timeout: Duration,
    /// Connections one peer address may hold at once; one more is closed on accept.
    pub max_connections_per_peer: usize,
}

/// Connections held per peer address.
#[derive(Clone, Default)]
struct Peers(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// One of a peer's connections; gives its place back when dropped.
struct Slot {
    peers: Peers,
    ip: IpAddr,
}

impl Peers {
    fn take(&self, ip: IpAddr, limit: usize) -> Option<Slot> {
        let mut held = self.0.lock().unwrap();
        let count = held.entry(ip).or_default();
        if *count >= limit {
            return None;
        }
        *count += 1;
        metrics::gauge!(metric::FRONT_CONNECTIONS_OPEN.name).increment(1.0);
        Some(Slot { peers: self.clone(), ip })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        metrics::gauge!(metric::FRONT_CONNECTIONS_OPEN.name).decrement(1.0);
        let mut held = self.peers.0.lock().unwrap();
        if let Some(count) = held.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.ip);
            }
        }
    }
}

/// Serves `router` on an already-bound listener within `limits` until `shutdown`, then lets the
/// connections in flight finish their requests (the caller bounds how long).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let peers = Peers::default();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pass, rather than spin on it.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Some(slot) = peers.take(peer.ip(), limits.max_connections_per_peer) else {
            metrics::counter!(metric::FRONT_CONNECTIONS_REFUSED.name).increment(1);
            tracing::debug!(%peer, "refusing a connection: the peer holds front.max_connections_per_peer");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(router.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            let _slot = slot;
            if let Err(e) = connection.await {
                tracing::debug!(%peer, error = %e, "front connection ended");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
