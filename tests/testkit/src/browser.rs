//! A real headless browser: `chromedriver` on a free loopback port, driving `chromium`.
//!
//! The console's tests speak WebDriver to it; this only starts the driver, says when it is ready,
//! and says how to launch the browser (headless, no sandbox, which a root CI container needs,
//! and a throwaway profile).

use std::time::Duration;

use tempfile::TempDir;

use crate::binary::Binary;
use crate::net::free_ports;
use crate::process::{Launch, Probe, ServerProcess, wait_for};

/// How long chromedriver may take to answer `/status` ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `chromedriver` and the `chromium` it launches.
#[derive(Debug)]
pub struct ChromeDriver {
    // Invariant: declared before `dir`, so the driver is killed before its dir is deleted.
    _process: ServerProcess,
    port: u16,
    chromium: std::path::PathBuf,
    dir: TempDir,
}

impl ChromeDriver {
    /// Starts chromedriver and waits until it is ready. Panics naming the Debian package when
    /// `chromium` or `chromedriver` is missing.
    #[must_use]
    pub fn start() -> Self {
        let chromium = Binary::Chromium.require();
        let chromedriver = Binary::ChromeDriver.require();
        let dir = tempfile::tempdir().expect("allot-testkit: temp dir for chromedriver");
        let port = free_ports(1)[0];
        let launch = Launch {
            label: format!("chromedriver on port {port}"),
            program: chromedriver,
            args: vec![
                format!("--port={port}"),
                "--allowed-ips=127.0.0.1".to_owned(),
            ],
            log: dir.path().join("chromedriver.log"),
        };
        let mut process = launch.spawn();
        let ready = wait_for(&launch.label, READY_TIMEOUT, || {
            if let Some(exit) = process.exited() {
                return Probe::Fatal(exit);
            }
            match status(port) {
                Ok(body) if body.contains("\"ready\":true") => Probe::Ready(()),
                Ok(body) => Probe::NotYet(body),
                Err(e) => Probe::NotYet(e.to_string()),
            }
        });
        if let Err(why) = ready {
            panic!("{why}\n{}", launch.log_tail());
        }
        Self {
            _process: process,
            port,
            chromium,
            dir,
        }
    }

    /// The WebDriver endpoint.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The W3C capabilities that launch a headless Chromium of `width`x`height` pixels with a
    /// profile in this driver's temp dir.
    #[must_use]
    pub fn capabilities(
        &self,
        width: u32,
        height: u32,
    ) -> serde_json::Map<String, serde_json::Value> {
        self.capabilities_with(width, height, &[])
    }

    /// [`ChromeDriver::capabilities`] with more Chromium switches (say `--force-dark-mode`).
    #[must_use]
    pub fn capabilities_with(
        &self,
        width: u32,
        height: u32,
        extra_args: &[&str],
    ) -> serde_json::Map<String, serde_json::Value> {
        let profile = self.dir.path().join(format!("profile-{}", next_profile()));
        let options = serde_json::json!({
            "binary": self.chromium.display().to_string(),
            "args": [
                "--headless=new",
                "--no-sandbox",
                "--disable-dev-shm-usage",
                "--disable-gpu",
                "--no-first-run",
                "--hide-scrollbars",
                format!("--window-size={width},{height}"),
                format!("--user-data-dir={}", profile.display()),
            ],
        });
        let mut options = options;
        if let Some(args) = options["args"].as_array_mut() {
            args.extend(extra_args.iter().map(|arg| serde_json::Value::from(*arg)));
        }
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".to_owned(), "chrome".into());
        capabilities.insert("goog:chromeOptions".to_owned(), options);
        capabilities
    }
}

fn next_profile() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// chromedriver's `/status` answer. chromedriver refuses HTTP/1.0 and keeps HTTP/1.1 connections
/// open, so this reads until the JSON body is complete (or the read times out).
fn status(port: u16) -> std::io::Result<String> {
    use std::io::{Read, Write};
    let timeout = Some(Duration::from_secs(2));
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(timeout)?;
    stream.set_write_timeout(timeout)?;
    write!(
        stream,
        "GET /status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    let mut chunk = [0u8; 4_096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => response.extend_from_slice(&chunk[..n]),
            Err(e) if response.is_empty() => return Err(e),
            Err(_) => break,
        }
        let text = String::from_utf8_lossy(&response);
        if text.contains("\"ready\"") && text.trim_end().ends_with('}') {
            break;
        }
    }
    Ok(String::from_utf8_lossy(&response).into_owned())
}
