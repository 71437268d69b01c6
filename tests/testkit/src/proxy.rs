//! A fault-injecting TCP proxy: the network between two real processes, under a test's control.
//!
//! These machines' kernels have no netem, so partitions are made in user space: a client is pointed
//! at the proxy instead of its server, and the test switches the proxy between passing traffic,
//! refusing it (a clean cut: new connections are closed, open ones are shut down) and holding it (a
//! black hole: connections are accepted and nothing is forwarded, so the client's own timeouts fire),
//! and can add latency to every chunk forwarded.
//!
//! Plain threads (two per connection), so the testkit stays free of an async runtime. Bounded: at
//! most [`MAX_CONNECTIONS`] connections at once; beyond that new ones are closed.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::Duration;

/// Most connections a proxy holds at once (I10).
pub const MAX_CONNECTIONS: usize = 256;

/// What the proxy does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward both ways.
    Pass,
    /// A clean cut: close new connections at once and shut down open ones.
    Refuse,
    /// A black hole: accept connections, forward nothing (the client times out).
    Hold,
}

impl ProxyMode {
    fn code(self) -> u8 {
        match self {
            ProxyMode::Pass => 0,
            ProxyMode::Refuse => 1,
            ProxyMode::Hold => 2,
        }
    }

    fn of(code: u8) -> Self {
        match code {
            1 => ProxyMode::Refuse,
            2 => ProxyMode::Hold,
            _ => ProxyMode::Pass,
        }
    }
}

struct Shared {
    target: SocketAddr,
    mode: AtomicU8,
    latency_ms: AtomicU64,
    stopped: AtomicBool,
    /// Both halves of every open connection, to shut them down on a cut.
    open: Mutex<Vec<(TcpStream, TcpStream)>>,
}

impl Shared {
    fn mode(&self) -> ProxyMode {
        ProxyMode::of(self.mode.load(Ordering::SeqCst))
    }

    fn cut_open_connections(&self) {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        for (client, server) in open.drain(..) {
            let _ = client.shutdown(Shutdown::Both);
            let _ = server.shutdown(Shutdown::Both);
        }
    }
}

/// A proxy from a loopback port to `target`. Stops (and cuts every connection) on drop.
pub struct FaultProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
}

impl FaultProxy {
    /// Starts a proxy to `target` on a free loopback port, passing traffic.
    pub fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .expect("allot-testkit: cannot bind a proxy port");
        let address = listener
            .local_addr()
            .expect("a bound listener has an address");
        let shared = Arc::new(Shared {
            target,
            mode: AtomicU8::new(ProxyMode::Pass.code()),
            latency_ms: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            open: Mutex::new(Vec::new()),
        });
        let accepting = shared.clone();
        thread::spawn(move || accept_loop(&listener, &accepting));
        Self { address, shared }
    }

    /// The address clients should use instead of the target's.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// `http://<address>`, for HTTP clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Switches the mode. Leaving `Pass` cuts the open connections (a held connection stays
    /// accepted but silent).
    pub fn set_mode(&self, mode: ProxyMode) {
        self.shared.mode.store(mode.code(), Ordering::SeqCst);
        if mode != ProxyMode::Pass {
            self.shared.cut_open_connections();
        }
    }

    /// The mode in force.
    pub fn mode(&self) -> ProxyMode {
        self.shared.mode()
    }

    /// Delays every forwarded chunk by this much (both directions).
    pub fn set_latency(&self, latency: Duration) {
        let ms = u64::try_from(latency.as_millis()).unwrap_or(u64::MAX);
        self.shared.latency_ms.store(ms, Ordering::SeqCst);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.shared.cut_open_connections();
        // Wake the accept loop so it sees the stop.
        let _ = TcpStream::connect_timeout(&self.address, Duration::from_millis(100));
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for incoming in listener.incoming() {
        if shared.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = incoming else { continue };
        match shared.mode() {
            ProxyMode::Refuse => {
                let _ = client.shutdown(Shutdown::Both);
            }
            ProxyMode::Hold => {
                // Accepted and kept, silent: dropped when the proxy is cut or stopped.
                let mut open = shared.open.lock().unwrap_or_else(PoisonError::into_inner);
                if open.len() < MAX_CONNECTIONS
                    && let Ok(copy) = client.try_clone()
                {
                    open.push((client, copy));
                }
            }
            ProxyMode::Pass => {
                let Ok(server) = TcpStream::connect_timeout(&shared.target, Duration::from_secs(2))
                else {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let halves = (client.try_clone(), server.try_clone());
                let (Ok(client_copy), Ok(server_copy)) = halves else {
                    continue;
                };
                {
                    let mut open = shared.open.lock().unwrap_or_else(PoisonError::into_inner);
                    open.retain(|(c, _)| c.peer_addr().is_ok());
                    if open.len() >= MAX_CONNECTIONS {
                        let _ = client.shutdown(Shutdown::Both);
                        continue;
                    }
                    if let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) {
                        open.push((c, s));
                    }
                }
                let (up, down) = (shared.clone(), shared.clone());
                thread::spawn(move || pump(client, server_copy, &up));
                thread::spawn(move || pump(server, client_copy, &down));
            }
        }
    }
}

/// Copies `from` to `to` until either side closes or the proxy stops passing traffic.
fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared) {
    let mut buffer = [0_u8; 16 * 1024];
    loop {
        let read = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if shared.mode() != ProxyMode::Pass || shared.stopped.load(Ordering::SeqCst) {
            break;
        }
        let latency = shared.latency_ms.load(Ordering::SeqCst);
        if latency > 0 {
            thread::sleep(Duration::from_millis(latency));
        }
        if write_all(&mut to, &buffer[..read]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

fn write_all(to: &mut TcpStream, bytes: &[u8]) -> io::Result<()> {
    to.write_all(bytes)?;
    to.flush()
}
