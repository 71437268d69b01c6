//! Where a server listens: a TCP address, or a Unix domain socket (`unix:/path`) for callers on the
//! same host. A gateway beside its agent skips the kernel's loopback TCP path (the larger part of
//! the agent's CPU per decision) and is guarded by the socket file's permissions instead of a port.
//!
//! A Unix socket's file is created at bind (one left by a process that died is replaced; any other
//! file there is refused, never removed) and removed when the listener is dropped.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

/// The prefix that names a Unix domain socket.
pub const UNIX_PREFIX: &str = "unix:";

/// A listening address: `host:port`, or `unix:/path/to/socket`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ListenAddr {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix domain socket's path.
    Unix(PathBuf),
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.strip_prefix(UNIX_PREFIX) {
            Some("") => Err("unix: needs a socket path, e.g. unix:/run/allot/agent.sock".into()),
            Some(path) => Ok(Self::Unix(PathBuf::from(path))),
            None => text.parse().map(Self::Tcp).map_err(|_| {
                format!("{text:?} is neither host:port (127.0.0.1:8080) nor unix:/path/to/socket")
            }),
        }
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Tcp(address) => write!(f, "{address}"),
            Self::Unix(path) => write!(f, "{UNIX_PREFIX}{}", path.display()),
        }
    }
}

impl From<SocketAddr> for ListenAddr {
    fn from(address: SocketAddr) -> Self {
        Self::Tcp(address)
    }
}

/// A bound listener of either kind.
#[derive(Debug)]
pub enum Listener {
    /// Over TCP.
    Tcp(TcpListener),
    /// On a Unix domain socket, with the path its file is removed from when dropped.
    Unix(UnixListener, PathBuf),
}

impl From<TcpListener> for Listener {
    fn from(listener: TcpListener) -> Self {
        Self::Tcp(listener)
    }
}

impl Listener {
    /// Binds `address`. A Unix socket's parent folder must exist; a stale socket file there is
    /// replaced, any other file is an error.
    pub async fn bind(address: &ListenAddr) -> std::io::Result<Self> {
        match address {
            ListenAddr::Tcp(address) => Ok(Self::Tcp(TcpListener::bind(address).await?)),
            ListenAddr::Unix(path) => {
                remove_stale_socket(path)?;
                Ok(Self::Unix(UnixListener::bind(path)?, path.clone()))
            }
        }
    }

    /// Where it listens (with the port the kernel chose, for TCP port 0).
    pub fn local_addr(&self) -> std::io::Result<ListenAddr> {
        match self {
            Self::Tcp(listener) => listener.local_addr().map(ListenAddr::Tcp),
            Self::Unix(_, path) => Ok(ListenAddr::Unix(path.clone())),
        }
    }

    /// The next connection.
    pub async fn accept(&self) -> std::io::Result<Accepted> {
        match self {
            Self::Tcp(listener) => {
                let (stream, _) = listener.accept().await?;
                // Decisions are small writes answered at once: never wait to coalesce them.
                let _ = stream.set_nodelay(true);
                Ok(Accepted::Tcp(stream))
            }
            Self::Unix(listener, _) => Ok(Accepted::Unix(listener.accept().await?.0)),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Self::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Removes a socket file a process that died left at `path`; refuses a socket something still
/// listens on (another agent's), and any other kind of file.
fn remove_stale_socket(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(metadata) if metadata.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::AddrInUse,
                    format!("{} is a socket another process listens on", path.display()),
                ));
            }
            std::fs::remove_file(path)
        }
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            format!("{} exists and is not a socket", path.display()),
        )),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(error) => Err(error),
    }
}

/// An accepted connection of either kind.
#[derive(Debug)]
pub enum Accepted {
    /// Over TCP.
    Tcp(TcpStream),
    /// On a Unix domain socket.
    Unix(UnixStream),
}

impl AsyncRead for Accepted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(stream) => Pin::new(stream).poll_read(cx, buf),
            Self::Unix(stream) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(stream) => Pin::new(stream).poll_write(cx, buf),
            Self::Unix(stream) => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Self::Unix(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Tcp(stream) => stream.is_write_vectored(),
            Self::Unix(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(stream) => Pin::new(stream).poll_flush(cx),
            Self::Unix(stream) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(stream) => Pin::new(stream).poll_shutdown(cx),
            Self::Unix(stream) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_as_tcp_or_unix_and_print_as_they_were_written() {
        for text in ["127.0.0.1:8080", "[::1]:9000", "unix:/run/allot/agent.sock"] {
            let address: ListenAddr = text.parse().expect(text);
            assert_eq!(address.to_string(), text);
        }
        assert!(matches!("unix:/a".parse(), Ok(ListenAddr::Unix(_))));
        for (text, says) in [
            ("unix:", "needs a socket path"),
            ("localhost", "neither host:port"),
            ("8080", "neither host:port"),
        ] {
            let refused = text.parse::<ListenAddr>().expect_err(text);
            assert!(refused.contains(says), "{text}: {refused}");
        }
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_another_file_is_refused_and_the_socket_goes_with_its_listener()
     {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("agent.sock");
        let address = ListenAddr::Unix(path.clone());
        // A socket left by a process that died: its file is there, nothing listens.
        drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
        assert!(path.exists());
        let listener = Listener::bind(&address)
            .await
            .expect("replaces the stale socket");
        // A live one is another agent's: refused, and left alone.
        let refused = Listener::bind(&address).await.expect_err("in use");
        assert_eq!(refused.kind(), std::io::ErrorKind::AddrInUse, "{refused}");
        let client = tokio::spawn({
            let path = path.clone();
            async move { UnixStream::connect(path).await }
        });
        assert!(matches!(listener.accept().await, Ok(Accepted::Unix(_))));
        client.await.expect("joined").expect("connected");
        drop(listener);
        assert!(!path.exists(), "removed with its listener");
        std::fs::write(&path, "data").expect("a file");
        let refused = Listener::bind(&address).await.expect_err("not a socket");
        assert!(refused.to_string().contains("is not a socket"), "{refused}");
        assert!(path.exists(), "never removed");
    }
}
