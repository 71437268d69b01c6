//! The operator console in a real headless Chromium, against the real-process topology (etcd
//! cluster, two allocators, an agent per region with its Redis, a PostgreSQL ledger).
//!
//! An admin signs in and mints an author and a viewer token; the author creates a pool with an
//! invalid chunk, sees the field error, fixes it; traffic through an agent updates a pool's live
//! window without a reload; the author publishes and promotes a bundle; the viewer sees but cannot
//! change anything; a cross-site form post changes nothing; the admin revokes the author's token,
//! which ends the author's session.
//!
//! Set `ALLOT_CONSOLE_SCREENSHOTS=DIR` to save the screenshots docs/console.md shows
//! (`scripts/console-screenshots` does).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use allot_testkit::ChromeDriver;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::Value;

use crate::topology::{Counts, OPERATOR, Topology, drive};

/// The viewport the docs' screenshots are taken at.
const WIDTH_PX: u32 = 1280;
const HEIGHT_PX: u32 = 800;

async fn browser(driver: &ChromeDriver) -> Client {
    browser_with(driver, &[]).await
}

async fn browser_with(driver: &ChromeDriver, extra_args: &[&str]) -> Client {
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(driver.capabilities_with(WIDTH_PX, HEIGHT_PX, extra_args))
        .connect(&driver.url())
        .await
        .expect("a WebDriver session with headless Chromium")
}

/// Saves a screenshot named `name` when screenshots were asked for.
async fn screenshot(client: &Client, name: &str) {
    let Some(dir) = std::env::var_os("ALLOT_CONSOLE_SCREENSHOTS") else {
        return;
    };
    let png = client.screenshot().await.expect("screenshot");
    let path = std::path::Path::new(&dir).join(format!("{name}.png"));
    std::fs::write(&path, png).expect("write screenshot");
}

/// The text of the element at `css`, waiting up to 10 s for it (a click's navigation may still
/// be loading).
async fn text_of(client: &Client, css: &str) -> String {
    let mut last_error = None;
    for _ in 0..100 {
        match client.find(Locator::Css(css)).await {
            Ok(element) => match element.text().await {
                Ok(text) => return text,
                Err(e) => last_error = Some(e),
            },
            Err(e) => last_error = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let url = client.current_url().await.map(|u| u.to_string());
    let source = client.source().await.unwrap_or_default();
    panic!("{css} not found at {url:?}: {last_error:?}\n{source}")
}

async fn page_text(client: &Client) -> String {
    text_of(client, "body").await
}

async fn fill(client: &Client, css: &str, value: &str) {
    let field = client.find(Locator::Css(css)).await.expect(css);
    field.clear().await.expect("clear");
    field.send_keys(value).await.expect("type");
}

async fn submit(client: &Client, form_css: &str) {
    client
        .find(Locator::Css(&format!("{form_css} button[type=submit]")))
        .await
        .expect("a submit button")
        .click()
        .await
        .expect("click");
}

async fn sign_in(client: &Client, base: &str, token: &str) {
    client
        .goto(&format!("{base}/console/"))
        .await
        .expect("open the console");
    assert!(
        client
            .current_url()
            .await
            .expect("url")
            .path()
            .ends_with("/sign-in")
    );
    screenshot(client, "sign-in").await;
    fill(client, "#token", token).await;
    submit(client, "form").await;
    wait_for(client, "the pools page", 10, async || {
        client
            .current_url()
            .await
            .is_ok_and(|u| u.path() == "/console/pools")
    })
    .await;
}

async fn wait_for(client: &Client, what: &str, seconds: u64, mut check: impl AsyncFnMut() -> bool) {
    for _ in 0..seconds * 10 {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let url = client.current_url().await.map(|u| u.to_string());
    let text = client.source().await.unwrap_or_default();
    panic!("timed out after {seconds} s waiting for {what} at {url:?}:\n{text}");
}

/// Mints a token with `role` on the tokens page and reads it from the page (shown once).
async fn mint(client: &Client, base: &str, role: &str, name: &str) -> String {
    client
        .goto(&format!("{base}/console/tokens"))
        .await
        .expect("tokens");
    fill(client, "#name", name).await;
    client
        .find(Locator::Css(&format!("#role option[value='{role}']")))
        .await
        .expect("role option")
        .click()
        .await
        .expect("choose role");
    submit(client, "form[action='/console/tokens']").await;
    let token = text_of(client, "#minted-token").await;
    assert!(token.starts_with("allot_"), "{token}");
    token
}

/// A page on another site (another host name) with a form that posts a pool to the console.
async fn serve_forgery(target: String) -> (String, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let body = format!(
        "<!doctype html><html><body><form id=\"forged\" method=\"post\" action=\"{target}/console/pools/new\">\
         <input name=\"tenant\" value=\"forged\"><input name=\"pool\" value=\"api\">\
         <input name=\"limit\" value=\"5\"><input name=\"windowMs\" value=\"60000\"><input name=\"chunk\" value=\"1\">\
         <input name=\"leaseTtlMs\" value=\"10000\"><input name=\"fallbackPerRegion\" value=\"0\">\
         <input name=\"regions\" value=\"eu\"><button type=\"submit\">Win a prize</button></form></body></html>"
    );
    let task = tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut request = vec![0u8; 8_192];
            let _ = stream.read(&mut request).await;
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    // `localhost` is another site than `127.0.0.1`, where the console is served.
    (format!("http://localhost:{port}/"), task)
}

async fn api_status(topology: &Topology, base: &str, path: &str) -> (u16, Value) {
    let response = topology
        .client
        .get(format!("{base}{path}"))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("api");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

#[tokio::test]
async fn operators_use_the_console_in_a_real_browser() {
    let topology = Topology::start("allot_console").await;
    let base = topology.wait_for_leader(30).await;
    let driver = ChromeDriver::start();

    // An admin signs in and mints an author and a viewer token.
    let admin = browser(&driver).await;
    sign_in(&admin, &base, OPERATOR).await;
    assert!(
        page_text(&admin).await.contains("drill"),
        "the topology's pool is listed"
    );
    screenshot(&admin, "pools").await;
    let author_token = mint(&admin, &base, "author", "release-bot").await;
    screenshot(&admin, "tokens-minted").await;
    let viewer_token = mint(&admin, &base, "viewer", "on-call").await;

    // The author creates a pool with a chunk larger than G, sees the field error, fixes it.
    let author = browser(&driver).await;
    sign_in(&author, &base, &author_token).await;
    author
        .goto(&format!("{base}/console/pools/new"))
        .await
        .expect("new pool");
    for (field, value) in [
        ("#tenant", "shop"),
        ("#pool", "api"),
        ("#limit", "600"),
        ("#windowMs", "60000"),
        ("#chunk", "5000"),
        ("#leaseTtlMs", "10000"),
        ("#fallbackPerRegion", "20"),
        ("#regions", "eu, us"),
    ] {
        fill(&author, field, value).await;
    }
    submit(&author, "form.stack").await;
    let error = text_of(&author, "#chunk-error").await;
    assert!(error.contains("at most limit"), "{error}");
    let chunk = author.find(Locator::Css("#chunk")).await.expect("chunk");
    assert_eq!(
        chunk.attr("aria-invalid").await.expect("attr").as_deref(),
        Some("true")
    );
    screenshot(&author, "pool-field-error").await;
    fill(&author, "#chunk", "50").await;
    submit(&author, "form.stack").await;
    wait_for(&author, "the new pool's page", 10, async || {
        author
            .current_url()
            .await
            .is_ok_and(|u| u.path() == "/console/pools/shop/api")
    })
    .await;
    assert!(
        page_text(&author)
            .await
            .contains("Bound = 600 + 0 + 40 + 0 + 0 = 640")
    );
    assert_eq!(
        api_status(&topology, &base, "/v1/pools/shop/api").await.1["chunk"],
        50
    );

    // Traffic through the EU agent: the pool's live window updates without a reload.
    author
        .goto(&format!("{base}/console/pools/drill/api"))
        .await
        .expect("pool page");
    let before = text_of(&author, "#admitted").await;
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let load = tokio::spawn(drive(
        topology.client.clone(),
        topology.agents["eu"].url.clone(),
        40,
        counts.clone(),
        stop.clone(),
    ));
    wait_for(&author, "admitted tokens to appear live", 60, async || {
        text_of(&author, "#admitted")
            .await
            .parse::<u64>()
            .is_ok_and(|admitted| admitted > 0)
    })
    .await;
    stop.store(true, Ordering::SeqCst);
    let _ = load.await;
    assert_eq!(before, "0", "the window had no admits before the traffic");
    assert_eq!(
        author.current_url().await.expect("url").path(),
        "/console/pools/drill/api",
        "no navigation happened"
    );
    assert!(Counts::get(&counts.allowed) > 0);
    let rows = author
        .find_all(Locator::Css("#windows tbody tr"))
        .await
        .expect("window rows");
    assert!(!rows.is_empty());
    let eu_row = text_of(&author, "#regions-now tbody tr").await;
    assert!(eu_row.starts_with("eu"), "{eu_row}");
    let chart = author.find(Locator::Css("img.chart")).await.expect("chart");
    let chart_src = chart.attr("src").await.expect("src").unwrap_or_default();
    assert!(chart_src.contains("/chart.svg?v="), "{chart_src}");
    screenshot(&author, "pool-live").await;

    // The author publishes a bundle to a canary region, then promotes it.
    author
        .goto(&format!("{base}/console/policies"))
        .await
        .expect("policies");
    // Chosen as a file: the console's script reads it into the bundle box.
    let bundle_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/examples/northstar-bundle.json")
        .canonicalize()
        .expect("the example bundle");
    let bundle_path = bundle_path.display().to_string();
    let bundle = include_str!("../../../deploy/examples/northstar-bundle.json");
    author
        .find(Locator::Css("#bundle-file"))
        .await
        .expect("file input")
        .send_keys(&bundle_path)
        .await
        .expect("choose the file");
    wait_for(&author, "the file in the bundle box", 10, async || {
        let Ok(textarea) = author.find(Locator::Css("#bundle")).await else {
            return false;
        };
        textarea
            .prop("value")
            .await
            .ok()
            .flatten()
            .is_some_and(|value| value == bundle)
    })
    .await;
    fill(&author, "#canary", "eu").await;
    submit(&author, "form[action='/console/policies/publish']").await;
    wait_for(&author, "a promote button", 10, async || {
        page_text(&author).await.contains("Promote 1")
    })
    .await;
    screenshot(&author, "policies").await;
    submit(&author, "form[action='/console/policies/1/promote']").await;
    wait_for(&author, "version 1 to be current", 10, async || {
        text_of(&author, "#current-version").await == "1"
    })
    .await;
    assert_eq!(
        api_status(&topology, &base, "/v1/policies/status").await.1["rollout"]["current"],
        1
    );

    // The viewer sees everything and can change nothing, even by opening the form directly.
    let viewer = browser(&driver).await;
    sign_in(&viewer, &base, &viewer_token).await;
    let listed = page_text(&viewer).await;
    assert!(
        listed.contains("shop") && !listed.contains("New pool"),
        "{listed}"
    );
    viewer
        .goto(&format!("{base}/console/pools/shop/api"))
        .await
        .expect("pool");
    assert!(!page_text(&viewer).await.contains("Edit"));
    viewer
        .goto(&format!("{base}/console/pools/new"))
        .await
        .expect("form");
    fill(&viewer, "#tenant", "viewer").await;
    fill(&viewer, "#pool", "api").await;
    fill(&viewer, "#limit", "10").await;
    fill(&viewer, "#chunk", "1").await;
    fill(&viewer, "#regions", "eu").await;
    submit(&viewer, "form.stack").await;
    wait_for(&viewer, "the API's refusal", 10, async || {
        page_text(&viewer).await.contains("role author")
    })
    .await;
    assert_eq!(
        api_status(&topology, &base, "/v1/pools/viewer/api").await.0,
        404
    );
    viewer
        .goto(&format!("{base}/console/regions"))
        .await
        .expect("regions");
    screenshot(&viewer, "regions").await;
    let regions = page_text(&viewer).await;
    assert!(regions.contains("Fallback in use"), "{regions}");
    assert!(regions.contains("Shards led"), "{regions}");

    // Keyboard: Tab walks from the page's start into the navigation.
    viewer
        .goto(&format!("{base}/console/pools"))
        .await
        .expect("pools");
    let body = viewer.find(Locator::Css("body")).await.expect("body");
    body.send_keys("\u{E004}\u{E004}").await.expect("tab twice");
    let focused = viewer.active_element().await.expect("focus");
    assert_eq!(
        focused.text().await.expect("text"),
        "Pools",
        "the second stop is the first section"
    );
    // A phone: the pools page fits the width (no sideways scrolling).
    viewer.set_window_size(390, 844).await.expect("phone size");
    viewer.refresh().await.expect("reload");
    let widths = viewer
        .execute(
            "return [document.documentElement.scrollWidth, window.innerWidth];",
            Vec::new(),
        )
        .await
        .expect("measure");
    let (scroll, inner) = (widths[0].as_u64(), widths[1].as_u64());
    assert!(scroll.is_some() && scroll <= inner, "{widths}");
    screenshot(&viewer, "pools-phone").await;

    // Dark: a browser that prefers dark colours gets a dark page.
    let dark = browser_with(&driver, &["--force-dark-mode"]).await;
    sign_in(&dark, &base, &viewer_token).await;
    let background = dark
        .execute(
            "return getComputedStyle(document.body).backgroundColor;",
            Vec::new(),
        )
        .await
        .expect("background");
    assert_eq!(
        background, "rgb(17, 20, 24)",
        "the dark palette's background"
    );
    dark.goto(&format!("{base}/console/pools/drill/api"))
        .await
        .expect("pool");
    screenshot(&dark, "pool-dark").await;
    let _ = dark.close().await;

    // A form on another site posting to the console (the admin is signed in) changes nothing.
    let (evil, evil_server) = serve_forgery(base.clone()).await;
    admin.goto(&evil).await.expect("the other site");
    submit(&admin, "#forged").await;
    wait_for(&admin, "the refusal", 10, async || {
        admin.current_url().await.is_ok_and(|u| u.path() != "/")
    })
    .await;
    let refused = page_text(&admin).await;
    assert!(
        refused.contains("another site") || refused.contains("Operator token"),
        "refused, or not signed in at all: {refused}"
    );
    evil_server.abort();
    assert_eq!(
        api_status(&topology, &base, "/v1/pools/forged/api").await.0,
        404
    );

    // The admin revokes the author's token (confirming); the author's session ends.
    admin
        .goto(&format!("{base}/console/tokens"))
        .await
        .expect("tokens");
    let revoke = admin
        .find(Locator::XPath(
            "//tr[td[normalize-space()='release-bot']]//button[normalize-space()='Revoke']",
        ))
        .await
        .expect("the author token's revoke button");
    revoke.click().await.expect("click revoke");
    admin.accept_alert().await.expect("confirm the revocation");
    wait_for(&admin, "the token to leave the list", 10, async || {
        !page_text(&admin).await.contains("release-bot")
    })
    .await;
    wait_for(&author, "the author's session to end", 15, async || {
        let _ = author.goto(&format!("{base}/console/pools")).await;
        author
            .current_url()
            .await
            .is_ok_and(|u| u.path() == "/console/sign-in")
    })
    .await;

    // The audit log shows who did what.
    admin
        .goto(&format!("{base}/console/audit"))
        .await
        .expect("audit");
    let audit = page_text(&admin).await;
    for action in [
        "pool.put",
        "policy.publish",
        "policy.promote",
        "token.mint",
        "token.revoke",
    ] {
        assert!(
            audit.contains(action),
            "{action} in the audit log:\n{audit}"
        );
    }
    for client in [admin, author, viewer] {
        let _ = client.close().await;
    }
    drop(driver);
    topology.assert_no_panic();
    topology.stop().await;
}
