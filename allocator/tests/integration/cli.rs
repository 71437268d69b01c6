//! `allotctl` against a real allocator: every command's happy path, the `--json` output, and one-line
//! errors with a non-zero exit.

use std::process::Output;

use crate::common::{AGENT, OPERATOR, start};

async fn allotctl(server: &str, token: &str, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_allotctl"));
    command
        .args(["--server", server, "--token", token])
        .args(args)
        .env_remove("ALLOT_TOKEN")
        .env_remove("ALLOT_SERVER");
    command.output().await.expect("allotctl runs")
}

fn stdout(output: &Output) -> String {
    assert!(
        output.status.success(),
        "allotctl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_drive_the_allocator_with_allotctl() {
    let server = start().await;
    let url = server.url.as_str();
    let set = allotctl(
        url,
        OPERATOR,
        &[
            "pools",
            "set",
            "atlas",
            "api",
            "--limit",
            "1000",
            "--chunk",
            "100",
            "--fallback",
            "100",
            "--regions",
            "eu,us",
        ],
    )
    .await;
    let set = stdout(&set);
    assert!(set.contains("version 1, lease ttl 15000 ms"), "{set}");
    let list = stdout(&allotctl(url, OPERATOR, &["pools", "list"]).await);
    assert!(
        list.lines().nth(1).is_some_and(|l| l.starts_with("atlas")),
        "{list}"
    );

    let grant = stdout(
        &allotctl(
            url,
            AGENT,
            &[
                "--json", "grant", "atlas", "api", "--region", "eu", "--want", "40",
            ],
        )
        .await,
    );
    let grant: serde_json::Value = serde_json::from_str(&grant).expect("--json prints JSON");
    assert_eq!(grant["granted"], 40);
    let lease = grant["leaseId"].as_str().expect("lease id");
    let again = stdout(
        &allotctl(
            url,
            AGENT,
            &[
                "--json",
                "grant",
                "atlas",
                "api",
                "--region",
                "eu",
                "--want",
                "99",
                "--lease-id",
                lease,
            ],
        )
        .await,
    );
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&again).expect("json")["granted"],
        40
    );

    let human = stdout(
        &allotctl(
            url,
            AGENT,
            &["grant", "atlas", "api", "--region", "eu", "--want", "5"],
        )
        .await,
    );
    assert!(human.starts_with("granted 5 tokens to eu"), "{human}");
    let pool = stdout(&allotctl(url, OPERATOR, &["pools", "get", "atlas", "api"]).await);
    assert!(
        pool.contains("955 tokens left") && pool.contains("granted: eu 45"),
        "{pool}"
    );

    // The ledger copies grants right after they commit, through a feed: wait for both.
    let mut windows = String::new();
    for _ in 0..100 {
        windows =
            stdout(&allotctl(url, OPERATOR, &["windows", "atlas", "api", "--last", "3"]).await);
        if windows.lines().nth(1).is_some_and(|l| l.contains(" 45 ")) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        windows.lines().nth(1).is_some_and(|l| l.contains(" 45 ")),
        "{windows}"
    );

    let bundle = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/examples/northstar-bundle.json"
    );
    let published = stdout(&allotctl(url, OPERATOR, &["policies", "publish", bundle]).await);
    assert!(
        published.starts_with("bundle version 1 (5 rules), sha256:"),
        "{published}"
    );
    let status = stdout(&allotctl(url, OPERATOR, &["policies", "status"]).await);
    assert!(status.starts_with("current v1, latest v1"), "{status}");

    // Replay a small sample offline against a candidate that allows a bigger burst.
    let dir = tempfile::tempdir().expect("temp dir");
    let sample = dir.path().join("sample.jsonl");
    let lines: Vec<String> = (0..25)
        .map(|n| {
            serde_json::json!({ "atMs": 1_000_000, "request": { "requestId": format!("r-{n}"), "tenantId": "birch",
                "principal": { "type": "user", "id": "U-17" }, "routeGroup": "read", "method": "GET" } })
            .to_string()
        })
        .collect();
    std::fs::write(&sample, lines.join("\n")).expect("sample");
    let candidate = dir.path().join("candidate.json");
    let text = std::fs::read_to_string(bundle).expect("bundle");
    std::fs::write(
        &candidate,
        text.replacen("\"capacityMillis\": 20000", "\"capacityMillis\": 30000", 1),
    )
    .expect("candidate");
    let replay = stdout(
        &allotctl(
            url,
            OPERATOR,
            &[
                "policies",
                "replay",
                "--bundle",
                candidate.to_str().expect("path"),
                "--sample",
                sample.to_str().expect("path"),
            ],
        )
        .await,
    );
    assert!(
        replay.starts_with("25 requests: denied 20.00% now (v1), 0.00% with the candidate"),
        "{replay}"
    );
    assert!(replay.contains("read-user-v3"), "{replay}");

    // The same limit dark-launched as a shadow rule: it denies nothing and says what it would
    // deny; with --enforce, who would be denied and what the global pool would not spend.
    let shadow = dir.path().join("shadow.json");
    std::fs::write(
        &shadow,
        text.replacen("\"failMode\"", "\"mode\": \"shadow\", \"failMode\"", 1),
    )
    .expect("shadow candidate");
    let replay_shadow = |enforce: bool| {
        let mut args = vec![
            "policies".to_owned(),
            "replay".to_owned(),
            "--bundle".to_owned(),
            shadow.to_str().expect("path").to_owned(),
            "--sample".to_owned(),
            sample.to_str().expect("path").to_owned(),
        ];
        if enforce {
            args.push("--enforce".to_owned());
        }
        args
    };
    let args = replay_shadow(false);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let shadowed = stdout(&allotctl(url, OPERATOR, &args).await);
    assert!(shadowed.contains("0.00% with the candidate"), "{shadowed}");
    assert!(
        shadowed.contains("shadow/soft read-user-v3: would have denied 5"),
        "{shadowed}"
    );
    let args = replay_shadow(true);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let enforced = stdout(&allotctl(url, OPERATOR, &args).await);
    assert!(enforced.contains("20.00% with the candidate"), "{enforced}");
    assert!(
        enforced.contains("principals denied with the candidate: 1"),
        "{enforced}"
    );
    assert!(enforced.contains("birch U-17 denied 5"), "{enforced}");
    assert!(
        enforced.contains("pool api: 5 tokens the denied requests would not spend"),
        "{enforced}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_one_line_with_a_non_zero_exit() {
    let server = start().await;
    let url = server.url.as_str();
    let bad = allotctl(
        url,
        OPERATOR,
        &[
            "pools",
            "set",
            "atlas",
            "api",
            "--limit",
            "10",
            "--chunk",
            "100",
            "--regions",
            "eu",
        ],
    )
    .await;
    assert_eq!(bad.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with(
            "allotctl: 400 Bad Request: must be at least 1 and at most limit (field chunk)"
        ),
        "{stderr}"
    );
    let unauthorized = allotctl(url, "wrong-token-0000000000", &["pools", "list"]).await;
    assert_eq!(unauthorized.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&unauthorized.stderr).starts_with("allotctl: 401"));
    let unreachable = allotctl("http://127.0.0.1:9", OPERATOR, &["pools", "list"]).await;
    assert_eq!(unreachable.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&unreachable.stderr).starts_with("allotctl: cannot reach"));
    let usage = allotctl(url, OPERATOR, &["pools", "frobnicate"]).await;
    assert_eq!(usage.status.code(), Some(2), "usage errors exit 2");

    // Calendar windows: a monthly plan, shown as such; an unknown zone is one line naming it.
    let set_monthly = |zone: &'static str| async move {
        let args = [
            "pools",
            "set",
            "atlas",
            "plan",
            "--limit",
            "1000",
            "--calendar",
            "month",
            "--time-zone",
            zone,
            "--chunk",
            "100",
            "--regions",
            "eu",
        ];
        allotctl(url, OPERATOR, &args).await
    };
    let monthly = stdout(&set_monthly("Europe/Berlin").await);
    assert!(monthly.contains("month in Europe/Berlin"), "{monthly}");
    let bad_zone = set_monthly("Europe/Atlantis").await;
    assert_eq!(bad_zone.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&bad_zone.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("(field window.timeZone)"), "{stderr}");
    let half = allotctl(
        url,
        OPERATOR,
        &[
            "pools",
            "set",
            "atlas",
            "plan",
            "--limit",
            "1",
            "--chunk",
            "1",
            "--regions",
            "eu",
            "--calendar",
            "month",
        ],
    )
    .await;
    assert_eq!(half.status.code(), Some(2), "--calendar needs --time-zone");
}

/// Runs `allotctl` expecting a one-line failure with exit 1; the line.
async fn failure(server: &str, args: &[&str]) -> String {
    let output = allotctl(server, OPERATOR, args).await;
    assert_eq!(output.status.code(), Some(1), "{args:?}");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policies_promote_only_goes_up_and_rollback_republishes_older_content() {
    let server = start().await;
    let url = server.url.as_str();
    let bundle = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/examples/northstar-bundle.json"
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let candidate = dir.path().join("candidate.json");
    let text = std::fs::read_to_string(bundle).expect("bundle");
    std::fs::write(
        &candidate,
        text.replacen("\"capacityMillis\": 20000", "\"capacityMillis\": 30000", 1),
    )
    .expect("candidate");
    for file in [bundle, candidate.to_str().expect("path")] {
        stdout(&allotctl(url, OPERATOR, &["policies", "publish", file]).await);
    }

    let refused = failure(url, &["policies", "promote", "1"]).await;
    assert!(
        refused
            .starts_with("allotctl: 409 Conflict: version 1 is older than the current version 2"),
        "{refused}"
    );
    let rolled = stdout(&allotctl(url, OPERATOR, &["policies", "rollback", "1"]).await);
    assert!(
        rolled.starts_with("bundle version 3 (5 rules), sha256:"),
        "{rolled}"
    );
    let status = stdout(&allotctl(url, OPERATOR, &["policies", "status"]).await);
    assert!(status.starts_with("current v3, latest v3\n"), "{status}");
    let json = stdout(&allotctl(url, OPERATOR, &["--json", "policies", "rollback", "2"]).await);
    let json: serde_json::Value = serde_json::from_str(&json).expect("--json prints JSON");
    assert_eq!(json["bundleVersion"], 4);
    let unknown = failure(url, &["policies", "rollback", "9"]).await;
    assert!(unknown.starts_with("allotctl: 404"), "{unknown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_audit_with_allotctl() {
    let server = start().await;
    let url = server.url.as_str();
    let minted = stdout(
        &allotctl(
            url,
            OPERATOR,
            &["tokens", "mint", "--role", "viewer", "--name", "dashboards"],
        )
        .await,
    );
    let token = minted.lines().last().expect("token line").trim().to_owned();
    assert!(token.starts_with("allot_"), "{minted}");
    let id = minted
        .split_whitespace()
        .find(|w| w.starts_with("tok-"))
        .expect("id")
        .to_owned();
    // The minted viewer reads but may not write.
    assert!(stdout(&allotctl(url, &token, &["pools", "list"]).await).starts_with("tenant"));
    let write = allotctl(
        url,
        &token,
        &[
            "pools",
            "set",
            "a",
            "b",
            "--limit",
            "1",
            "--chunk",
            "1",
            "--regions",
            "eu",
        ],
    )
    .await;
    assert!(String::from_utf8_lossy(&write.stderr).starts_with("allotctl: 403"));
    let list = stdout(&allotctl(url, OPERATOR, &["tokens", "list"]).await);
    assert!(list.contains(&id) && list.contains("dashboards"), "{list}");
    assert!(!list.contains(&token), "{list}");
    stdout(&allotctl(url, OPERATOR, &["tokens", "revoke", &id]).await);
    let revoked = allotctl(url, &token, &["pools", "list"]).await;
    assert!(String::from_utf8_lossy(&revoked.stderr).starts_with("allotctl: 401"));
    let audit = stdout(&allotctl(url, OPERATOR, &["audit"]).await);
    let actions: Vec<&str> = audit
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(2))
        .collect();
    assert_eq!(actions, ["token.revoke", "token.mint"], "{audit}");

    // `tokens digest` prints what a token file line may hold instead of the token.
    let mut digest = tokio::process::Command::new(env!("CARGO_BIN_EXE_allotctl"));
    let digest = digest
        .args(["tokens", "digest"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let mut digest = digest;
    {
        use tokio::io::AsyncWriteExt;
        let mut stdin = digest.stdin.take().expect("stdin");
        stdin
            .write_all(b"some-token-of-32-characters-0001\n")
            .await
            .expect("write");
    }
    let output = digest.wait_with_output().await.expect("digest");
    let printed = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    assert_eq!(
        printed,
        allot_allocator::auth::TokenDigest::of("some-token-of-32-characters-0001").to_string()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_apply_a_file_and_list_walks_every_page() {
    let server = start().await;
    let url = server.url.as_str();
    let dir = tempfile::tempdir().expect("temp dir");
    let line = |n: usize, limit: u64| {
        serde_json::json!({ "tenant": format!("team{}", n % 3), "pool": format!("p{n:04}"),
            "spec": { "limit": limit, "windowMs": 60000, "chunk": 10, "leaseTtlMs": 10000,
                      "fallbackPerRegion": 0, "regions": ["eu"] } })
        .to_string()
    };
    // 1,001 pools: two calls of the bulk API, and two pages of the list.
    let file = dir.path().join("pools.jsonl");
    let lines: Vec<String> = (0..1_001).map(|n| line(n, 100)).collect();
    std::fs::write(&file, format!("{}\n\n", lines.join("\n"))).expect("write");
    let path = file.to_str().expect("utf-8 path");
    let applied = stdout(&allotctl(url, OPERATOR, &["pools", "apply", "--file", path]).await);
    assert_eq!(applied, "created 1001, updated 0, unchanged 0\n");
    let again = stdout(&allotctl(url, OPERATOR, &["pools", "apply", "--file", path]).await);
    assert_eq!(
        again, "created 0, updated 0, unchanged 1001\n",
        "applying again is a no-op"
    );

    let list = stdout(&allotctl(url, OPERATOR, &["pools", "list"]).await);
    assert_eq!(
        list.lines().count(),
        1 + 1_001,
        "a header and every pool: {}",
        &list[..200]
    );
    let team1 = stdout(&allotctl(url, OPERATOR, &["pools", "list", "--prefix", "team1/"]).await);
    assert_eq!(team1.lines().count(), 1 + 334);
    assert!(team1.lines().skip(1).all(|l| l.starts_with("team1")));
    let page = stdout(
        &allotctl(
            url,
            OPERATOR,
            &["pools", "list", "--prefix", "team2/", "--limit", "2"],
        )
        .await,
    );
    assert!(
        page.contains("more: the next page is --after team2/p0005"),
        "{page}"
    );
    let next = stdout(
        &allotctl(
            url,
            OPERATOR,
            &[
                "pools",
                "list",
                "--prefix",
                "team2/",
                "--limit",
                "2",
                "--after",
                "team2/p0005",
            ],
        )
        .await,
    );
    assert!(
        next.lines().nth(1).is_some_and(|l| l.contains("p0008")),
        "{next}"
    );

    // A bad line is named with its number, and nothing of the file is sent.
    let mut bad_lines = vec![line(5_000, 100), line(5_001, 100)];
    bad_lines.push(line(5_002, 0));
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, bad_lines.join("\n")).expect("write");
    let stderr = failure(
        url,
        &["pools", "apply", "--file", bad.to_str().expect("path")],
    )
    .await;
    assert!(stderr.contains("bad.jsonl line 3:"), "{stderr}");
    assert!(stderr.contains("(field spec.limit)"), "{stderr}");
    let list = stdout(&allotctl(url, OPERATOR, &["pools", "list", "--prefix", "team"]).await);
    assert!(
        !list.contains("p5000"),
        "nothing of a refused file is written"
    );
    let usage = allotctl(url, OPERATOR, &["pools", "list", "--after", "team1/p0001"]).await;
    assert_eq!(usage.status.code(), Some(2), "--after needs --limit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_export_prints_every_record_as_json_lines_or_csv() {
    let server = start().await;
    let url = server.url.as_str();
    stdout(
        &allotctl(
            url,
            OPERATOR,
            &[
                "pools",
                "set",
                "atlas",
                "api",
                "--limit",
                "1000",
                "--chunk",
                "100",
                "--regions",
                "eu,us",
            ],
        )
        .await,
    );
    let now_ms = allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock);
    let start_ms = (now_ms / 60_000 - 2) * 60_000;
    let (tenant, pool) = (
        allot_shared::ids::TenantId::parse("atlas").expect("tenant"),
        allot_shared::ids::PoolId::parse("api").expect("pool"),
    );
    for region in ["eu", "us"] {
        let record: allot_allocator::pools::GrantRecord = serde_json::from_value(serde_json::json!({
            "leaseId": allot_shared::ids::LeaseId::from_parts(start_ms, rand::random()),
            "region": region, "granted": 50, "epoch": 1, "windowStartMs": start_ms,
            "windowEndMs": start_ms + 60_000, "expiresAtMs": start_ms + 30_000, "retryAfterMs": 0 }))
        .expect("grant record");
        server
            .ledger
            .record_grants(&tenant, &pool, &[record])
            .await
            .expect("grant");
    }
    let (from, to) = ((now_ms - 600_000).to_string(), now_ms.to_string());
    let jsonl = stdout(
        &allotctl(
            url,
            OPERATOR,
            &["usage", "export", "--from", &from, "--to", &to],
        )
        .await,
    );
    let lines: Vec<serde_json::Value> = jsonl
        .lines()
        .map(|line| serde_json::from_str(line).expect("JSON line"))
        .collect();
    assert_eq!(lines.len(), 2, "{jsonl}");
    assert_eq!(lines[0]["region"], "eu");
    assert_eq!(lines[1]["granted"], 50);
    let csv = stdout(
        &allotctl(
            url,
            OPERATOR,
            &[
                "usage", "export", "--from", &from, "--to", &to, "--format", "csv",
            ],
        )
        .await,
    );
    assert_eq!(csv.lines().count(), 3, "a header and two records: {csv}");
    assert!(csv.starts_with("recordId,tenant,pool,region,"), "{csv}");
    let bad = failure(url, &["usage", "export", "--from", &to, "--to", &from]).await;
    assert!(bad.contains("(field to)"), "{bad}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_are_set_listed_and_ended_with_allotctl() {
    let server = start().await;
    let url = server.url.as_str();
    stdout(
        &allotctl(
            url,
            OPERATOR,
            &[
                "pools",
                "set",
                "atlas",
                "api",
                "--limit",
                "1000",
                "--chunk",
                "100",
                "--regions",
                "eu",
            ],
        )
        .await,
    );
    let set = stdout(
        &allotctl(
            url,
            OPERATOR,
            &[
                "--json",
                "overrides",
                "set",
                "atlas",
                "--pool",
                "api",
                "--limit",
                "5000",
                "--for",
                "7d",
                "--reason",
                "launch week",
            ],
        )
        .await,
    );
    let created: serde_json::Value = serde_json::from_str(&set).expect("json");
    let id = created["id"].as_str().expect("id").to_owned();
    let week_ms = 7 * 86_400_000;
    let lasts_ms = created["expiresAtMs"].as_u64().expect("an end")
        - created["startsAtMs"].as_u64().expect("a start");
    assert!(lasts_ms.abs_diff(week_ms) < 60_000, "{created}");
    let list = stdout(&allotctl(url, OPERATOR, &["overrides", "list", "--tenant", "atlas"]).await);
    assert!(
        list.contains(&id) && list.contains("pool api") && list.contains("limit 5000"),
        "{list}"
    );
    let ended =
        stdout(&allotctl(url, OPERATOR, &["--json", "overrides", "end", "atlas", &id]).await);
    let ended: serde_json::Value = serde_json::from_str(&ended).expect("json");
    assert!(ended["expiresAtMs"].as_u64() < created["expiresAtMs"].as_u64());

    // Bad input: one line and exit 1, naming what was wrong.
    let line = failure(
        url,
        &[
            "overrides",
            "set",
            "atlas",
            "--pool",
            "api",
            "--reason",
            "x",
        ],
    )
    .await;
    assert!(line.contains("limit"), "{line}");
    let line = failure(
        url,
        &[
            "overrides",
            "set",
            "atlas",
            "--pool",
            "api",
            "--limit",
            "5",
            "--for",
            "soon",
            "--reason",
            "x",
        ],
    )
    .await;
    assert!(line.contains("--for"), "{line}");

    // The hash agents key a user by, worked out offline from their pepper.
    let dir = tempfile::tempdir().expect("temp dir");
    let pepper_file = dir.path().join("pepper");
    std::fs::write(&pepper_file, b"cli-test-pepper-0123").expect("pepper");
    let pepper_path = pepper_file.to_str().expect("utf-8 path");
    let hash = stdout(
        &allotctl(
            url,
            OPERATOR,
            &[
                "principal-hash",
                "--type",
                "user",
                "--pepper-file",
                pepper_path,
                "alice",
            ],
        )
        .await,
    );
    let expected = allot_shared::keys::principal_hash(
        &allot_shared::keys::Pepper::new(b"cli-test-pepper-0123".to_vec()).expect("pepper"),
        allot_shared::contract::PrincipalType::User,
        "alice",
        allot_shared::keys::IpPrefixes::default(),
    );
    assert_eq!(hash.trim(), expected.as_str());
    let line = failure(
        url,
        &[
            "principal-hash",
            "--type",
            "ip",
            "--pepper-file",
            pepper_path,
            "x",
        ],
    )
    .await;
    assert!(line.contains("--type"), "{line}");
}
