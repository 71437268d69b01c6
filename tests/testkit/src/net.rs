//! Loopback plumbing: free ports, and just enough HTTP and RESP to ask a server
//! whether it is ready, so the testkit needs no async runtime or client crate.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

/// How long one readiness request may take. Short, because the caller polls.
const IO_TIMEOUT: Duration = Duration::from_secs(2);

/// `n` distinct loopback ports that were free a moment ago.
///
/// Each comes from binding `127.0.0.1:0` and reading the port the kernel chose.
/// All listeners are held until every port is picked, so the ports are distinct;
/// then they are dropped so the server can bind them. Between that drop and the
/// server's bind, another process (or an outgoing connection's ephemeral port)
/// can take the port: a small race that callers absorb by starting the server
/// again on fresh ports when its log says "address already in use".
pub(crate) fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| {
            TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
                .expect("allot-testkit: cannot bind 127.0.0.1:0 to find a free port")
        })
        .collect();
    listeners
        .iter()
        .map(|l| {
            l.local_addr()
                .expect("a bound listener has an address")
                .port()
        })
        .collect()
}

fn connect(port: u16) -> io::Result<TcpStream> {
    let stream =
        TcpStream::connect_timeout(&SocketAddr::from((Ipv4Addr::LOCALHOST, port)), IO_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    Ok(stream)
}

/// Sends one HTTP/1.0 request to `127.0.0.1:port` and returns the response body.
///
/// HTTP/1.0 makes the server close the connection after the response, so the
/// body is simply everything after the headers: no chunking, no keep-alive.
/// The status code is not checked: etcd answers an unhealthy `/health` with 503
/// and a body that says why, which is what the caller wants to see.
pub(crate) fn http(
    port: u16,
    method: &str,
    path: &str,
    json_body: Option<&str>,
) -> io::Result<String> {
    let mut stream = connect(port)?;
    let body = json_body.unwrap_or("");
    let content = match json_body {
        Some(_) => format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ),
        None => String::new(),
    };
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n{content}\r\n{body}"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    response
        .split_once("\r\n\r\n")
        .map(|(_headers, body)| body.to_owned())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not an HTTP response: {response:?}"),
            )
        })
}

/// A Redis reply, as far as readiness checks need one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Reply {
    /// `+OK`, `+PONG`.
    Status(String),
    /// `-ERR ...`, `-CLUSTERDOWN ...`.
    Error(String),
    /// `:42`.
    Integer(i64),
    /// `$n` followed by n bytes; `None` for the nil bulk `$-1`.
    Bulk(Option<String>),
}

/// Sends one command to the Redis server on `127.0.0.1:port` and reads its reply.
pub(crate) fn redis_command(port: u16, args: &[&str]) -> io::Result<Reply> {
    let mut stream = connect(port)?;
    let mut request = format!("*{}\r\n", args.len());
    for arg in args {
        request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
    }
    stream.write_all(request.as_bytes())?;
    read_reply(&mut BufReader::new(stream))
}

/// Parses one RESP2 reply; arrays are not needed and are rejected.
pub(crate) fn read_reply(input: &mut impl BufRead) -> io::Result<Reply> {
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    let mut line = String::new();
    input.read_line(&mut line)?;
    let Some(line) = line.strip_suffix("\r\n") else {
        return Err(invalid(format!("unterminated RESP line {line:?}")));
    };
    let (kind, rest) = line
        .split_at_checked(1)
        .ok_or_else(|| invalid("empty RESP line".into()))?;
    match kind {
        "+" => Ok(Reply::Status(rest.to_owned())),
        "-" => Ok(Reply::Error(rest.to_owned())),
        ":" => rest
            .parse()
            .map(Reply::Integer)
            .map_err(|_| invalid(format!("bad RESP integer {rest:?}"))),
        "$" => {
            let len: i64 = rest
                .parse()
                .map_err(|_| invalid(format!("bad RESP bulk length {rest:?}")))?;
            let Ok(len) = usize::try_from(len) else {
                return Ok(Reply::Bulk(None));
            };
            let mut data = vec![0; len + 2];
            input.read_exact(&mut data)?;
            if !data.ends_with(b"\r\n") {
                return Err(invalid("RESP bulk string without trailing CRLF".into()));
            }
            data.truncate(len);
            String::from_utf8(data)
                .map(|s| Reply::Bulk(Some(s)))
                .map_err(|_| invalid("RESP bulk string is not UTF-8".into()))
        }
        _ => Err(invalid(format!("unsupported RESP reply {line:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str) -> io::Result<Reply> {
        read_reply(&mut raw.as_bytes())
    }

    #[test]
    fn free_ports_are_distinct_and_nonzero() {
        let ports = free_ports(6);

        let mut unique = ports.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), 6, "{ports:?}");
        assert!(!ports.contains(&0), "{ports:?}");
    }

    #[test]
    fn parses_the_reply_kinds_readiness_checks_see() {
        assert_eq!(
            parse("+PONG\r\n").expect("status"),
            Reply::Status("PONG".into())
        );
        assert_eq!(
            parse("-CLUSTERDOWN The cluster is down\r\n").expect("error"),
            Reply::Error("CLUSTERDOWN The cluster is down".into())
        );
        assert_eq!(parse(":16384\r\n").expect("integer"), Reply::Integer(16384));
        assert_eq!(
            parse("$21\r\ncluster_state:ok\r\nx:1\r\n").expect("bulk"),
            Reply::Bulk(Some("cluster_state:ok\r\nx:1".into()))
        );
        assert_eq!(parse("$-1\r\n").expect("nil"), Reply::Bulk(None));
    }

    #[test]
    fn rejects_truncated_and_unknown_replies() {
        assert!(parse("$10\r\nshort\r\n").is_err());
        assert!(parse("+PONG").is_err());
        assert!(parse("*1\r\n+OK\r\n").is_err());
    }
}
