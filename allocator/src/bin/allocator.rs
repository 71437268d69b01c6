//! `allocator`: parses settings and runs the server until SIGTERM or Ctrl-C.

use std::process::ExitCode;

use allot_allocator::server::{Args, open_store, run, system_clock};
use clap::Parser;

/// mimalloc: fewer cycles per allocation than the system allocator on the request path (measured
/// by the agent benchmark, docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}

#[tokio::main]
async fn main() -> ExitCode {
    // ALLOT_LOG sets the filter (default info); ALLOT_LOG_FORMAT=json emits one JSON object per line.
    let filter = tracing_subscriber::EnvFilter::try_from_env("ALLOT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter);
    if std::env::var("ALLOT_LOG_FORMAT").is_ok_and(|f| f == "json") {
        logs.json().init();
    } else {
        logs.init();
    }
    let settings = match Args::parse().resolve() {
        Ok(settings) => settings,
        Err(message) => {
            eprintln!("allocator: {message}");
            return ExitCode::from(2);
        }
    };
    let clock = system_clock();
    let kv = match open_store(&settings, clock.clone()).await {
        Ok(kv) => kv,
        Err(message) => {
            eprintln!("allocator: {message}");
            return ExitCode::from(1);
        }
    };
    let ledger = match allot_allocator::ledger::Ledger::connect(&settings.ledger_url).await {
        Ok(ledger) => ledger,
        Err(error) => {
            eprintln!("allocator: ledger {}: {error}", settings.ledger_url);
            return ExitCode::from(1);
        }
    };
    let listener = match tokio::net::TcpListener::bind(settings.listen).await {
        Ok(listener) => listener,
        Err(error) => {
            eprintln!("allocator: cannot listen on {}: {error}", settings.listen);
            return ExitCode::from(1);
        }
    };
    match run(settings, kv, ledger, clock, listener, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("allocator: {error}");
            ExitCode::from(1)
        }
    }
}
