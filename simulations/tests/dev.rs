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
        async move {
            let _ = stopped.await;
        },
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
