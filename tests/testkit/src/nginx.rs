//! A real `nginx`, in the foreground as one process, on free loopback ports, with its files in its
//! own temp dir: for the tests of Allot behind nginx's `auth_request`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;

use crate::binary::Binary;
use crate::net::{free_ports, http};
use crate::process::{Launch, Probe, ServerProcess, lost_port_race, wait_for};

/// How long nginx may take to answer its readiness probe.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How many times to pick fresh ports when another process took one first.
const PORT_ATTEMPTS: usize = 5;

/// A running nginx.
#[derive(Debug)]
pub struct Nginx {
    // Invariant: declared before `dir`, so nginx is killed before its dir is deleted.
    _process: ServerProcess,
    port: u16,
    dir: TempDir,
}

impl Nginx {
    /// Starts nginx serving the http-context configuration `http_conf(port)` (its `server` blocks
    /// listen on `port`), after writing `files` (name, contents) beside the main configuration, where
    /// relative `include`s find them. Returns once nginx answers; panics with its error log if it
    /// cannot start (a configuration nginx refuses included), naming the Debian package when nginx
    /// is not installed.
    #[must_use]
    pub fn start(files: &[(&str, String)], http_conf: impl Fn(u16) -> String) -> Self {
        let program = Binary::Nginx.require();
        let mut last_failure = String::new();
        for _ in 0..PORT_ATTEMPTS {
            let dir = tempfile::tempdir().expect("allot-testkit: temp dir for nginx");
            for (name, contents) in files {
                std::fs::write(dir.path().join(name), contents).unwrap_or_else(|e| {
                    panic!("allot-testkit: cannot write nginx file {name}: {e}")
                });
            }
            let [port, probe_port] = free_ports(2)[..] else {
                unreachable!("free_ports(2) gives two ports");
            };
            let conf = main_conf(dir.path(), probe_port, &http_conf(port));
            let conf_path = dir.path().join("nginx.conf");
            std::fs::write(&conf_path, conf).expect("allot-testkit: cannot write nginx.conf");
            let launch = Launch {
                label: format!("nginx on port {port}"),
                program: program.clone(),
                args: vec![
                    "-p".to_owned(),
                    dir.path().display().to_string(),
                    "-c".to_owned(),
                    conf_path.display().to_string(),
                ],
                log: dir.path().join("nginx.log"),
            };
            let mut process = launch.spawn();
            let ready = wait_for(&launch.label, READY_TIMEOUT, || {
                if let Some(exit) = process.exited() {
                    return Probe::Fatal(exit);
                }
                match http(probe_port, "GET", "/ready", None) {
                    Ok(body) if body == "ready" => Probe::Ready(()),
                    Ok(body) => Probe::NotYet(body),
                    Err(e) => Probe::NotYet(e.to_string()),
                }
            });
            match ready {
                Ok(()) => {
                    return Self {
                        _process: process,
                        port,
                        dir,
                    };
                }
                Err(why) => {
                    let tail = launch.log_tail();
                    if !lost_port_race(&tail) {
                        panic!("{why}\n{tail}");
                    }
                    last_failure = format!("{why}\n{tail}");
                }
            }
        }
        panic!("nginx lost the race for free ports {PORT_ATTEMPTS} times\n{last_failure}");
    }

    /// Where the configuration's servers listen: `http://127.0.0.1:<port>`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// nginx's log (its error log, at `info`), for failure messages and for tests that check
    /// what it recorded.
    #[must_use]
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("nginx.log")
    }
}

/// The main configuration: one process in the foreground (so killing it leaves no workers behind),
/// every file under `dir`, logs to stderr (the launch's log), a probe server on `probe_port`, then
/// the caller's http-context configuration.
fn main_conf(dir: &Path, probe_port: u16, http_conf: &str) -> String {
    let dir = dir.display();
    format!(
        "daemon off;
master_process off;
pid {dir}/nginx.pid;
error_log stderr info;
events {{ worker_connections 512; }}
http {{
    access_log off;
    client_body_temp_path {dir}/client_body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    server {{
        listen 127.0.0.1:{probe_port};
        location = /ready {{ return 200 ready; }}
    }}
{http_conf}
}}
"
    )
}
