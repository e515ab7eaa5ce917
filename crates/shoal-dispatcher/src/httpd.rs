//! The HTTP server of every shoal process (run control's API and UI, `/metrics` of nodes
//! and the dispatcher), guarded against hostile clients.
//!
//! `axum::serve` waits for a request's headers forever and accepts connections until the
//! process runs out of descriptors: a slowloris client (a byte a second) or a connection
//! flood would take the process's descriptors from its data path. Here:
//! - at most [`HttpLimits::per_peer`] connections per peer address and
//!   [`HttpLimits::total`] in all; one beyond is closed at once, counted;
//! - a request's headers must arrive within [`HttpLimits::header_timeout`], a request be
//!   answered within [`HttpLimits::request_timeout`] (408 otherwise); a WebSocket, once
//!   upgraded, is its handler's and not limited;
//! - every refusal and timeout is counted ([`HttpStats`]) and logged at most every 10 s
//!   with the count held back.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// How much of the process one HTTP server may hold.
#[derive(Clone, Copy, Debug)]
pub struct HttpLimits {
    pub per_peer: usize,
    pub total: usize,
    pub header_timeout: Duration,
    pub request_timeout: Duration,
}

impl Default for HttpLimits {
    /// 32 connections per peer, 512 in all (a browser opens 6; Prometheus 1), 10 s for the
    /// headers, 30 s for a request.
    fn default() -> Self {
        Self {
            per_peer: 32,
            total: 512,
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// What the guard refused or cut, for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct HttpStats {
    pub accepted: AtomicU64,
    /// Closed at once: the peer already had `per_peer` connections.
    pub refused_per_peer: AtomicU64,
    /// Closed at once: `total` connections were open.
    pub refused_total: AtomicU64,
    /// Ended by an error: headers too slow, malformed requests, resets.
    pub connection_errors: AtomicU64,
    pub request_timeouts: AtomicU64,
    pub open: AtomicU64,
    /// TLS handshakes refused or not made in time (a web configuration with TLS).
    pub tls_refused: AtomicU64,
    /// Requests without the basic-auth credentials the web configuration asks for (401).
    pub auth_refused: AtomicU64,
}

impl HttpStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// Counts open connections per peer; a [`Slot`] gives its place back when dropped.
#[derive(Default)]
struct Slots {
    per_peer: HashMap<IpAddr, usize>,
    total: usize,
}

struct Slot {
    slots: Arc<Mutex<Slots>>,
    peer: IpAddr,
    stats: Arc<HttpStats>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        s.total -= 1;
        if let Some(n) = s.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                s.per_peer.remove(&self.peer);
            }
        }
        self.stats.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Repeated warnings of every HTTP server of the process, at most every 10 s.
static SAID: crate::lograte::LogRate = crate::lograte::LogRate::new(Duration::from_secs(10));

fn say(name: &str, what: &str) {
    if let Some(held_back) = SAID.check() {
        warn!(server = name, held_back, "{what}");
    }
}

/// Serves `router` on `listener` until `cancel`, within `limits`. `name` names the server
/// in logs.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
    name: &'static str,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    serve_with(listener, router, limits, stats, name, None, cancel).await
}

/// The answer to a request without the basic-auth credentials a web configuration asks for.
fn basic_auth_refused() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        axum::http::StatusCode::UNAUTHORIZED,
        [(axum::http::header::WWW_AUTHENTICATE, "Basic realm=\"shoal\"")],
        "credentials required\n",
    )
        .into_response()
}

/// [`serve`] under a Prometheus web configuration (`web`: TLS with or without client
/// certificates, bcrypt basic-auth users). A TLS handshake must end within the header
/// timeout; one that fails is counted (`tls_refused`) and closes only its connection.
pub async fn serve_with(
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    stats: Arc<HttpStats>,
    name: &'static str,
    web: Option<Arc<shoal_tls::web::WebConfig>>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let router = match &web {
        Some(w) if w.requires_basic_auth() => {
            let w = w.clone();
            let refused = stats.clone();
            router.layer(axum::middleware::from_fn(move |req: axum::extract::Request, next: axum::middleware::Next| {
                let (w, refused) = (w.clone(), refused.clone());
                async move {
                    let header = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
                    if w.authorize(header) {
                        next.run(req).await
                    } else {
                        refused.auth_refused.fetch_add(1, Ordering::Relaxed);
                        basic_auth_refused()
                    }
                }
            }))
        }
        _ => router,
    };
    let tls = web.as_ref().and_then(|w| w.tls.clone()).map(tokio_rustls::TlsAcceptor::from);
    let timeout = limits.request_timeout;
    let timeouts = stats.clone();
    let router = router.layer(axum::middleware::from_fn(move |req, next: axum::middleware::Next| {
        let timeouts = timeouts.clone();
        async move {
            use axum::response::IntoResponse;
            match tokio::time::timeout(timeout, next.run(req)).await {
                Ok(r) => r,
                Err(_) => {
                    timeouts.request_timeouts.fetch_add(1, Ordering::Relaxed);
                    (axum::http::StatusCode::REQUEST_TIMEOUT, "request not answered in time").into_response()
                }
            }
        }
    }));
    let slots = Arc::new(Mutex::new(Slots::default()));
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors, most likely: keep serving those we have.
                    say(name, &format!("accept failed: {e}"));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = cancel.cancelled() => break,
        };
        let slot = {
            let mut s = slots.lock().unwrap_or_else(|e| e.into_inner());
            let mine = s.per_peer.get(&peer.ip()).copied().unwrap_or(0);
            if mine >= limits.per_peer || s.total >= limits.total {
                let (counter, why) = if mine >= limits.per_peer {
                    (&stats.refused_per_peer, "a peer over its connection limit: closed")
                } else {
                    (&stats.refused_total, "connection limit reached: closed")
                };
                counter.fetch_add(1, Ordering::Relaxed);
                say(name, &format!("{why} ({peer})"));
                drop(stream);
                continue;
            }
            *s.per_peer.entry(peer.ip()).or_default() += 1;
            s.total += 1;
            stats.open.fetch_add(1, Ordering::Relaxed);
            Slot { slots: slots.clone(), peer: peer.ip(), stats: stats.clone() }
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        // Handlers may ask who is calling (`ConnectInfo`): run control's guard audits it.
        let service = TowerToHyperService::new(router.clone().layer(axum::Extension(axum::extract::ConnectInfo(peer))));
        let (stats, cancel, tls) = (stats.clone(), cancel.clone(), tls.clone());
        connections.spawn(async move {
            // Each path frees the place and counts how the connection ended before its
            // socket closes: a peer that sees its connection end may connect again at once,
            // and finds the end already counted.
            let ended = Ended { slot, stats: &stats, name, peer };
            match tls {
                None => serve_connection(stream, service, limits, &cancel, ended).await,
                Some(tls) => {
                    // Pinned here, the handshake (and its socket) outlives a timeout's arm.
                    let handshake = tls.accept(stream).into_fallible();
                    tokio::pin!(handshake);
                    match tokio::time::timeout(limits.header_timeout, handshake.as_mut()).await {
                        Ok(Ok(stream)) => serve_connection(stream, service, limits, &cancel, ended).await,
                        Ok(Err((e, stream))) => {
                            ended.tls_refused(&format!("TLS handshake from {peer} refused: {e}"));
                            drop(stream);
                        }
                        Err(_) => ended.tls_refused(&format!("no TLS handshake from {peer} in time: closed")),
                    }
                }
            }
        });
    }
    connections.close();
    // Open connections were told to finish; a hostile one does not hold up the exit.
    let _ = tokio::time::timeout(Duration::from_secs(2), connections.wait()).await;
    Ok(())
}

/// How a connection ended, told while its socket is still open.
struct Ended<'a> {
    slot: Slot,
    stats: &'a HttpStats,
    name: &'static str,
    peer: SocketAddr,
}

impl Ended<'_> {
    fn tls_refused(self, why: &str) {
        drop(self.slot);
        self.stats.tls_refused.fetch_add(1, Ordering::Relaxed);
        say(self.name, why);
    }

    fn served(self, result: Result<(), hyper::Error>) {
        drop(self.slot);
        if let Err(e) = result {
            self.stats.connection_errors.fetch_add(1, Ordering::Relaxed);
            say(self.name, &format!("connection from {} ended: {e}", self.peer));
        }
    }
}

/// One HTTP/1 connection (plain or TLS) until it ends or `cancel` (then gracefully). The
/// end is told (`ended`) before the connection, and with it the socket, is dropped.
async fn serve_connection<I>(
    io: I,
    service: TowerToHyperService<Router>,
    limits: HttpLimits,
    cancel: &CancellationToken,
    ended: Ended<'_>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades();
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        _ = cancel.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.as_mut().await
        }
    };
    ended.served(result);
}
