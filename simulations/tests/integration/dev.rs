//! `allot dev` starts an allocator and two agents that load the example bundle from it, and stops
//! cleanly when asked.

use std::time::Duration;

use allot_simulations::dev::{DevOptions, run_dev};

/// A base port with the two above it free too (a small race with other processes, retried).
fn free_base_port() -> u16 {
    for _ in 0..50 {
        let Ok(listener) = std::net::TcpListener::bind("127.0.0.1:0") else {
            continue;
        };
        let Ok(base) = listener.local_addr().map(|a| a.port()) else {
            continue;
        };
        drop(listener);
        if base < 65_000
            && (1..=2).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok())
        {
            return base;
        }
    }
    panic!("no three consecutive free ports");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allot_dev_serves_and_stops() {
    let dir = tempfile::tempdir().expect("temp dir");
    let base = free_base_port();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let dev = tokio::spawn(run_dev(
        DevOptions {
            base_port: base,
            data_dir: dir.path().to_owned(),
            demo: false,
            demo_rate_per_s: 1,
        },
        Box::pin(async move {
            let _ = stopped.await;
        }),
    ));
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(5))
        .build()
        .expect("http client");
    for port in [base, base + 1, base + 2] {
        let mut ready = false;
        for _ in 0..200 {
            if let Ok(r) = client
                .get(format!("http://127.0.0.1:{port}/readyz"))
                .send()
                .await
                && r.status() == 200
            {
                let text = r.text().await.expect("text");
                ready = port == base || text.contains("policy version 1");
                if ready {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(ready, "port {port} never became ready");
    }
    stop.send(()).expect("dev is running");
    let finished = tokio::time::timeout(Duration::from_secs(10), dev)
        .await
        .expect("stops in time");
    assert!(finished.expect("task").is_ok());
}

/// The banner a newcomer reads: the console's address answers (with its sign-in page), and the
/// `allotctl` command it prints runs as printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_banner_names_a_console_and_an_allotctl_that_work() {
    use std::io::BufRead as _;
    let dir = tempfile::tempdir().expect("temp dir");
    let base = free_base_port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_allot"))
        .args(["dev", "--port", &base.to_string(), "--data-dir"])
        .arg(dir.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("allot dev starts");
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let logged = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let logging = logged.clone();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            logging.lock().expect("log").push(line);
        }
    });
    let (lines_out, lines) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            if lines_out.send(line).is_err() {
                break;
            }
        }
    });
    let mut banner = Vec::new();
    while let Ok(line) = lines.recv_timeout(Duration::from_secs(30)) {
        let done = line.contains("allotctl") && line.contains("windows atlas api");
        banner.push(line);
        if done {
            break;
        }
    }
    let text = banner.join("\n");
    // What dev sets up itself (its tokens, its regions) warns about nothing: a warning at start
    // would teach a newcomer to ignore them.
    let warnings: Vec<String> = logged
        .lock()
        .expect("log")
        .iter()
        .chain(&banner)
        .filter(|line| line.contains("WARN"))
        .cloned()
        .collect();
    assert!(
        warnings.is_empty(),
        "allot dev warned at start: {warnings:#?}"
    );
    let console_url = format!("http://127.0.0.1:{base}/console/");
    assert!(
        text.contains(&format!("console    {console_url}")),
        "{text}"
    );
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let console = client.get(&console_url).send().await.expect("console");
    assert_eq!(console.status(), 303, "signed out: to the sign-in page");
    let sign_in = client
        .get(format!("{console_url}sign-in"))
        .send()
        .await
        .expect("sign-in page");
    assert_eq!(sign_in.status(), 200);

    let command_line = banner
        .iter()
        .find(|line| line.contains("windows atlas api"))
        .expect("an allotctl line");
    let words: Vec<&str> = command_line.split_whitespace().collect();
    if std::path::Path::new(words[0]).is_file() {
        let output = std::process::Command::new(words[0])
            .args(&words[1..])
            .output()
            .expect("allotctl runs");
        assert!(
            output.status.success(),
            "{command_line}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    } else {
        assert!(
            command_line
                .trim_start()
                .starts_with("cargo run -q -p allot-allocator --bin allotctl --"),
            "without a built allotctl the banner says how to run one: {command_line}"
        );
    }
    let _ = child.kill();
    let _ = child.wait();
}
