//! The operator console, server side: every route needs a session, carries the security headers,
//! and every change needs the session's CSRF token and a same-site request; the console acts with
//! the signed-in token's role (the API decides) and shows the API's field errors on the form.

use reqwest::header::{CONTENT_SECURITY_POLICY, COOKIE, LOCATION, SET_COOKIE};
use reqwest::{Method, StatusCode};

use crate::common::{AGENT, AUTHOR, OPERATOR, Server, VIEWER, start};

/// A browser-like client: no automatic redirects, the session cookie sent by hand.
struct Browser {
    client: reqwest::Client,
    base: String,
    cookie: Option<String>,
}

struct Page {
    status: StatusCode,
    location: Option<String>,
    csp: Option<String>,
    set_cookie: Option<String>,
    text: String,
}

impl Page {
    /// The CSRF token the page's forms carry.
    fn csrf(&self) -> String {
        let marker = r#"name="csrf" value=""#;
        let start = self.text.find(marker).expect("the page has a form") + marker.len();
        let end = start + self.text[start..].find('"').expect("closing quote");
        self.text[start..end].to_owned()
    }
}

impl Browser {
    fn new(server: &Server) -> Self {
        Self {
            client: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .timeout(std::time::Duration::from_secs(10))
                .build()
                .expect("client"),
            base: server.url.clone(),
            cookie: None,
        }
    }

    async fn request(
        &self,
        method: Method,
        path: &str,
        form: &[(&str, &str)],
        extra: &[(&str, &str)],
    ) -> Page {
        let mut request = self
            .client
            .request(method.clone(), format!("{}{path}", self.base));
        if let Some(cookie) = &self.cookie {
            request = request.header(COOKIE, cookie);
        }
        for (name, value) in extra {
            request = request.header(*name, *value);
        }
        if method == Method::POST {
            request = request.form(form);
        }
        let response = request.send().await.expect("send");
        let header = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        Page {
            status: response.status(),
            location: header(LOCATION),
            csp: header(CONTENT_SECURITY_POLICY),
            set_cookie: header(SET_COOKIE),
            text: response.text().await.expect("text"),
        }
    }

    async fn get(&self, path: &str) -> Page {
        self.request(Method::GET, path, &[], &[]).await
    }

    /// A same-origin form post, as a browser sends it.
    async fn post(&self, path: &str, form: &[(&str, &str)]) -> Page {
        self.request(
            Method::POST,
            path,
            form,
            &[("sec-fetch-site", "same-origin")],
        )
        .await
    }

    async fn sign_in(&mut self, token: &str) -> Page {
        let page = self.post("/console/sign-in", &[("token", token)]).await;
        if let Some(set) = &page.set_cookie {
            self.cookie = set.split(';').next().map(str::to_owned);
        }
        page
    }
}

async fn signed_in(server: &Server, token: &str) -> Browser {
    let mut browser = Browser::new(server);
    let page = browser.sign_in(token).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER, "{}", page.text);
    browser
}

fn pool_form<'a>(csrf: &'a str, chunk: &'a str) -> Vec<(&'static str, &'a str)> {
    vec![
        ("csrf", csrf),
        ("tenant", "atlas"),
        ("pool", "api"),
        ("limit", "1000"),
        ("windowMs", "60000"),
        ("chunk", chunk),
        ("leaseTtlMs", "10000"),
        ("fallbackPerRegion", "50"),
        ("settleDebtPerRegion", "10"),
        ("regions", "eu, us"),
    ]
}

const PAGES: [&str; 13] = [
    "/console/",
    "/console/pools",
    "/console/pools/new",
    "/console/pools/atlas/api",
    "/console/pools/atlas/api/live",
    "/console/pools/atlas/api/chart.svg",
    "/console/pools/atlas/api/edit",
    "/console/regions",
    "/console/policies",
    "/console/tokens",
    "/console/audit",
    "/console/webhooks",
    "/console/overrides",
];

const CHANGES: [&str; 8] = [
    "/console/pools/new",
    "/console/pools/atlas/api/edit",
    "/console/pools/atlas/api/delete",
    "/console/policies/publish",
    "/console/policies/1/promote",
    "/console/policies/1/rollback",
    "/console/tokens",
    "/console/sign-out",
];

#[tokio::test]
async fn every_route_needs_a_session_and_carries_the_security_headers() {
    let server = start().await;
    let anonymous = Browser::new(&server);
    for path in PAGES {
        let page = anonymous.get(path).await;
        assert_eq!(page.status, StatusCode::SEE_OTHER, "GET {path}");
        assert_eq!(
            page.location.as_deref(),
            Some("/console/sign-in"),
            "GET {path}"
        );
        let csp = page.csp.unwrap_or_default();
        assert!(csp.contains("script-src 'self'"), "GET {path}: {csp}");
        assert!(!csp.contains("unsafe-inline"), "GET {path}: {csp}");
        assert!(csp.contains("frame-ancestors 'none'"), "GET {path}");
    }
    for path in CHANGES {
        let page = anonymous.post(path, &[("csrf", "x")]).await;
        assert_eq!(
            page.location.as_deref(),
            Some("/console/sign-in"),
            "POST {path}"
        );
    }
    let sign_in = anonymous.get("/console/sign-in").await;
    assert_eq!(sign_in.status, StatusCode::OK);
    assert!(
        sign_in
            .csp
            .is_some_and(|c| c.contains("default-src 'none'"))
    );
    assert!(!sign_in.text.contains("<script>"), "no inline script");

    // Signed in, every page renders (or says the API refused), with the same headers.
    let admin = signed_in(&server, OPERATOR).await;
    for path in PAGES {
        let page = admin.get(path).await;
        assert!(
            page.csp
                .as_deref()
                .is_some_and(|c| c.contains("script-src 'self'")),
            "GET {path}"
        );
        assert!(!page.text.contains("<script>"), "GET {path}: inline script");
    }
    let script = admin.get("/console/assets/console.js").await;
    assert_eq!(script.status, StatusCode::OK);
    assert!(script.text.contains("data-live"));
    assert_eq!(
        admin.get("/console/assets/other.js").await.status,
        StatusCode::NOT_FOUND
    );
}

#[tokio::test]
async fn sign_in_accepts_operator_tokens_only_and_sets_a_strict_cookie() {
    let server = start().await;
    let mut browser = Browser::new(&server);
    let wrong = browser.sign_in("not-a-token-anyone-holds-01").await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.text.contains("not accepted"));
    let agent = browser.sign_in(AGENT).await;
    assert_eq!(agent.status, StatusCode::FORBIDDEN);
    assert!(agent.set_cookie.is_none());

    let page = browser.sign_in(VIEWER).await;
    assert_eq!(page.status, StatusCode::SEE_OTHER);
    let cookie = page.set_cookie.expect("cookie");
    for attribute in ["HttpOnly", "SameSite=Strict", "Path=/console", "Max-Age="] {
        assert!(cookie.contains(attribute), "{cookie}");
    }
    assert!(!cookie.contains("Secure"), "plain HTTP listener");
    assert!(
        !cookie.contains(VIEWER),
        "the token never goes into the cookie"
    );

    // A sign-in posted from another site is refused, even with a good token.
    let forged = browser
        .request(
            Method::POST,
            "/console/sign-in",
            &[("token", OPERATOR)],
            &[("sec-fetch-site", "cross-site")],
        )
        .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN);
    assert!(forged.set_cookie.is_none());

    // Signing out ends the session on the server: the old cookie no longer works.
    let pools = browser.get("/console/pools").await;
    assert_eq!(pools.status, StatusCode::OK);
    // The bound checks of closed windows head the pool list (none closed yet here).
    assert!(
        pools
            .text
            .contains("0 windows checked against their bound, none over it"),
        "{}",
        pools.text
    );
    let out = browser
        .post("/console/sign-out", &[("csrf", &pools.csrf())])
        .await;
    assert_eq!(out.location.as_deref(), Some("/console/sign-in"));
    assert!(out.set_cookie.is_some_and(|c| c.contains("Max-Age=0")));
    assert_eq!(
        browser.get("/console/pools").await.status,
        StatusCode::SEE_OTHER
    );
}

#[tokio::test]
async fn an_author_creates_edits_and_deletes_a_pool_and_sees_field_errors() {
    let server = start().await;
    let author = signed_in(&server, AUTHOR).await;
    let new = author.get("/console/pools/new").await;
    assert_eq!(new.status, StatusCode::OK);
    let csrf = new.csrf();

    // A chunk larger than G: the API names the field and the form shows it beside the input.
    let refused = author
        .post("/console/pools/new", &pool_form(&csrf, "5000"))
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.text);
    assert!(
        refused.text.contains(
            r#"id="chunk" name="chunk" value="5000" inputmode="numeric" aria-invalid="true""#
        ),
        "{}",
        refused.text
    );
    assert!(refused.text.contains(r#"id="chunk-error""#));
    // Not a number at all: also named by the API.
    let typo = author
        .post("/console/pools/new", &pool_form(&csrf, "ten"))
        .await;
    assert_eq!(typo.status, StatusCode::BAD_REQUEST);
    assert!(typo.text.contains(r#"id="chunk-error""#), "{}", typo.text);
    assert_eq!(
        author.get("/console/pools/atlas/api").await.status,
        StatusCode::NOT_FOUND
    );

    let created = author
        .post("/console/pools/new", &pool_form(&csrf, "100"))
        .await;
    assert_eq!(created.status, StatusCode::SEE_OTHER, "{}", created.text);
    assert_eq!(
        created.location.as_deref(),
        Some("/console/pools/atlas/api")
    );
    let detail = author.get("/console/pools/atlas/api").await;
    assert_eq!(detail.status, StatusCode::OK);
    assert!(
        detail
            .text
            .contains("Bound = 1000 + 0 + 100 + 0 + 20 = <strong>1120</strong>"),
        "{}",
        detail.text
    );
    assert!(
        detail
            .text
            .contains(r#"data-live="/console/pools/atlas/api/live""#)
    );
    let chart = author.get("/console/pools/atlas/api/chart.svg").await;
    assert_eq!(chart.status, StatusCode::OK);
    assert!(chart.text.starts_with("<svg"));

    let list = author.get("/console/pools?q=atlas").await;
    assert!(list.text.contains(r#"href="/console/pools/atlas/api""#));
    assert!(list.text.contains("New pool"));
    let none = author.get("/console/pools?q=nomatch").await;
    assert!(!none.text.contains(r#"href="/console/pools/atlas/api""#));

    let mut edit = pool_form(&csrf, "200");
    edit.retain(|(name, _)| !matches!(*name, "tenant" | "pool"));
    let saved = author.post("/console/pools/atlas/api/edit", &edit).await;
    assert_eq!(saved.status, StatusCode::SEE_OTHER, "{}", saved.text);
    let (_, pool) = server_get(&server, "/v1/pools/atlas/api").await;
    assert_eq!(pool["chunk"], 200);

    let confirm = author.get("/console/pools/atlas/api/delete").await;
    assert!(confirm.text.contains("cannot be undone"));
    let deleted = author
        .post("/console/pools/atlas/api/delete", &[("csrf", &csrf)])
        .await;
    assert_eq!(deleted.location.as_deref(), Some("/console/pools"));
    assert_eq!(server_get(&server, "/v1/pools/atlas/api").await.0, 404);

    // A monthly plan: calendar windows instead of a length; an unknown zone is named beside it.
    let monthly = |zone: &'static str| {
        let mut form = pool_form(&csrf, "100");
        form.retain(|(name, _)| *name != "windowMs");
        form.extend([
            ("pool", "plan"),
            ("windowMs", ""),
            ("calendar", "month"),
            ("timeZone", zone),
            ("leaseTtlMs", "60000"),
        ]);
        form.retain(|(name, value)| !(*name == "pool" && *value == "api"));
        form.retain(|(name, value)| !(*name == "leaseTtlMs" && *value == "10000"));
        form
    };
    let refused = author
        .post("/console/pools/new", &monthly("Europe/Atlantis"))
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST, "{}", refused.text);
    assert!(
        refused.text.contains(
            r#"id="timeZone" name="timeZone" value="Europe/Atlantis" aria-invalid="true""#
        ),
        "{}",
        refused.text
    );
    let created = author
        .post("/console/pools/new", &monthly("Europe/Berlin"))
        .await;
    assert_eq!(created.status, StatusCode::SEE_OTHER, "{}", created.text);
    let (_, plan) = server_get(&server, "/v1/pools/atlas/plan").await;
    assert_eq!(plan["window"]["calendar"], "month", "{plan}");
    assert_eq!(plan["window"]["timeZone"], "Europe/Berlin", "{plan}");
    let page = author.get("/console/pools/atlas/plan").await;
    assert!(
        page.text.contains("tokens per month in Europe/Berlin"),
        "{}",
        page.text
    );
    let form = author.get("/console/pools/atlas/plan/edit").await;
    assert!(
        form.text
            .contains(r#"id="calendar" name="calendar" value="month""#),
        "the edit form keeps the calendar: {}",
        form.text
    );

    // The audit log names the author's changes.
    let audit = author.get("/console/audit?action=pool.put").await;
    assert!(audit.text.contains("atlas/api"), "{}", audit.text);
    assert!(!audit.text.contains("pool.delete</td>"));
}

async fn server_get(server: &Server, path: &str) -> (u16, serde_json::Value) {
    let response = server
        .client
        .get(format!("{}{path}", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("get");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or_default())
}

#[tokio::test]
async fn a_viewer_sees_but_cannot_change_and_forged_posts_change_nothing() {
    let server = start().await;
    let author = signed_in(&server, AUTHOR).await;
    let csrf = author.get("/console/pools/new").await.csrf();

    // Forged: no CSRF token, a wrong one, or sent from another site with the right one.
    for (form_csrf, site) in [
        ("", "same-origin"),
        ("0123", "same-origin"),
        (csrf.as_str(), "cross-site"),
    ] {
        let mut form = pool_form(form_csrf, "100");
        form.retain(|(name, _)| *name != "csrf" || !form_csrf.is_empty());
        let page = author
            .request(
                Method::POST,
                "/console/pools/new",
                &form,
                &[("sec-fetch-site", site)],
            )
            .await;
        assert_eq!(
            page.status,
            StatusCode::FORBIDDEN,
            "csrf {form_csrf:?} from {site}"
        );
    }
    let forged_origin = author
        .request(
            Method::POST,
            "/console/pools/new",
            &pool_form(&csrf, "100"),
            &[("origin", "https://evil.example")],
        )
        .await;
    assert_eq!(forged_origin.status, StatusCode::FORBIDDEN);
    assert_eq!(
        server_get(&server, "/v1/pools/atlas/api").await.0,
        404,
        "nothing was created"
    );

    let viewer = signed_in(&server, VIEWER).await;
    let list = viewer.get("/console/pools").await;
    assert_eq!(list.status, StatusCode::OK);
    assert!(
        !list.text.contains("New pool"),
        "the console hides what a viewer cannot do"
    );
    assert!(!list.text.contains(r#"href="/console/tokens""#));
    // Even posting the form directly, the API refuses the viewer.
    let viewer_csrf = list.csrf();
    let refused = viewer
        .post("/console/pools/new", &pool_form(&viewer_csrf, "100"))
        .await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", refused.text);
    assert!(refused.text.contains("role author"), "{}", refused.text);
    assert_eq!(server_get(&server, "/v1/pools/atlas/api").await.0, 404);
    assert_eq!(
        viewer.get("/console/tokens").await.status,
        StatusCode::FORBIDDEN
    );
    let mint = viewer
        .post(
            "/console/tokens",
            &[("csrf", &viewer_csrf), ("role", "admin"), ("name", "mine")],
        )
        .await;
    assert_eq!(mint.status, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn an_admin_mints_a_token_shown_once_and_revoking_it_ends_its_sessions() {
    let server = start().await;
    let admin = signed_in(&server, OPERATOR).await;
    let page = admin.get("/console/tokens").await;
    assert_eq!(page.status, StatusCode::OK);
    let csrf = page.csrf();

    let invalid = admin
        .post(
            "/console/tokens",
            &[("csrf", &csrf), ("role", "emperor"), ("name", "x")],
        )
        .await;
    assert_eq!(invalid.status, StatusCode::BAD_REQUEST, "{}", invalid.text);
    assert!(
        invalid.text.contains("role="),
        "the role field stays selectable"
    );

    let minted = admin
        .post(
            "/console/tokens",
            &[("csrf", &csrf), ("role", "viewer"), ("name", "dashboards")],
        )
        .await;
    assert_eq!(minted.status, StatusCode::OK, "{}", minted.text);
    let marker = r#"id="minted-token">"#;
    let start = minted.text.find(marker).expect("token shown") + marker.len();
    let token = minted.text[start..start + minted.text[start..].find('<').expect("end")].to_owned();
    assert!(token.starts_with("allot_"), "{token}");
    assert!(minted.text.contains(r#"data-copy="minted-token""#));
    assert!(
        !admin.get("/console/tokens").await.text.contains(&token),
        "shown once"
    );

    let minted_user = signed_in(&server, &token).await;
    assert_eq!(
        minted_user.get("/console/pools").await.status,
        StatusCode::OK
    );

    let list = admin.get("/console/tokens").await;
    let id_marker = "/console/tokens/";
    let id_start = list.text.find(id_marker).expect("a revoke form") + id_marker.len();
    let id =
        list.text[id_start..id_start + list.text[id_start..].find('/').expect("end")].to_owned();
    let revoked = admin
        .post(&format!("/console/tokens/{id}/revoke"), &[("csrf", &csrf)])
        .await;
    assert_eq!(
        revoked.location.as_deref(),
        Some("/console/tokens"),
        "{}",
        revoked.text
    );
    // The token book refreshes from the store within a couple of seconds.
    let mut signed_out = false;
    for _ in 0..60 {
        let page = minted_user.get("/console/pools").await;
        if page.location.as_deref() == Some("/console/sign-in") {
            signed_out = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(signed_out, "a revoked token's session ends");
}

#[tokio::test]
async fn policies_publish_with_field_errors_diff_promote_and_roll_back() {
    let server = start().await;
    let author = signed_in(&server, AUTHOR).await;
    let page = author.get("/console/policies").await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.text);
    assert!(page.text.contains("No bundle has been published yet"));
    let csrf = page.csrf();
    let early = author
        .post(
            "/console/policies/replay",
            &[("csrf", &csrf), ("candidate", "1"), ("sample", "{}")],
        )
        .await;
    assert_eq!(early.status, StatusCode::BAD_REQUEST);
    assert!(
        early.text.contains("no bundle is current yet"),
        "{}",
        early.text
    );

    let bundle = include_str!("../../../deploy/examples/northstar-bundle.json");
    let invalid = bundle.replacen("\"costMillis\": 1000,", "\"costMillis\": 99999,", 1);
    let refused = author
        .post(
            "/console/policies/publish",
            &[("csrf", &csrf), ("bundle", &invalid)],
        )
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(
        refused.text.contains("<code>rules[0].costMillis</code>"),
        "{}",
        refused.text
    );
    assert!(refused.text.contains("99999"), "the pasted text is kept");

    // Version 1 as it is, version 2 with a bigger burst, staged to a canary region.
    let candidate = bundle.replacen("\"capacityMillis\": 20000", "\"capacityMillis\": 30000", 1);
    for (text, canary) in [(bundle, ""), (candidate.as_str(), "eu")] {
        let published = author
            .post(
                "/console/policies/publish",
                &[("csrf", &csrf), ("bundle", text), ("canary", canary)],
            )
            .await;
        assert_eq!(
            published.location.as_deref(),
            Some("/console/policies"),
            "{}",
            published.text
        );
    }
    let page = author.get("/console/policies").await;
    assert!(page.text.contains("Promote 2"), "{}", page.text);
    let diff = author.get("/console/policies/diff?from=1&to=2").await;
    assert_eq!(diff.status, StatusCode::OK);
    let marked = |class: &str, text: &str| {
        diff.text
            .split(&format!(r#"<span class="{class}">"#))
            .skip(1)
            .filter_map(|rest| rest.split("</span>").next())
            .any(|line| line.contains(text))
    };
    assert!(
        marked("removed", "capacityMillis&quot;: 20000"),
        "{}",
        diff.text
    );
    assert!(
        marked("added", "capacityMillis&quot;: 30000"),
        "{}",
        diff.text
    );
    assert!(
        !marked("added", "refillMillis"),
        "unchanged lines are not marked"
    );
    let bad = author.get("/console/policies/diff?from=0&to=2").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    assert!(bad.text.contains("<code>from</code>"));

    // Replay prints what `allotctl policies replay` prints: version 1 (published to everyone, so
    // current) against the candidate.
    let lines: Vec<String> = (0..25)
        .map(|n| {
            serde_json::json!({ "atMs": 1_000_000, "request": { "requestId": format!("r-{n}"),
                "tenantId": "birch", "principal": { "type": "user", "id": "U-17" },
                "routeGroup": "read", "method": "GET" } })
            .to_string()
        })
        .collect();
    let sample = lines.join("\n");
    let replay = |sample: String| {
        let (author, csrf) = (&author, csrf.clone());
        async move {
            author
                .post(
                    "/console/policies/replay",
                    &[("csrf", &csrf), ("candidate", "2"), ("sample", &sample)],
                )
                .await
        }
    };
    let replayed = replay(sample.clone()).await;
    assert_eq!(replayed.status, StatusCode::OK, "{}", replayed.text);
    assert!(
        replayed
            .text
            .contains("25 requests: denied 20.00% now (v1), 0.00% with the candidate (v2)"),
        "{}",
        replayed.text
    );
    let garbled = replay(format!("{sample}\nnot json")).await;
    assert_eq!(garbled.status, StatusCode::BAD_REQUEST);
    assert!(
        garbled.text.contains("decision log line:26"),
        "{}",
        garbled.text
    );

    let promoted = author
        .post("/console/policies/2/promote", &[("csrf", &csrf)])
        .await;
    assert_eq!(promoted.location.as_deref(), Some("/console/policies"));
    let (_, status) = server_get(&server, "/v1/policies/status").await;
    assert_eq!(status["rollout"]["current"], 2);

    // Below the current version the console offers a rollback, never a promotion (agents never
    // go back to a lower version); a promotion asked for anyway shows the API's refusal.
    let page = author.get("/console/policies").await;
    assert!(
        page.text.contains("Roll back to 1") && !page.text.contains("Promote 1"),
        "{}",
        page.text
    );
    let refused = author
        .post("/console/policies/1/promote", &[("csrf", &csrf)])
        .await;
    assert_eq!(refused.status, StatusCode::CONFLICT);
    assert!(
        refused.text.contains("older than the current version 2"),
        "{}",
        refused.text
    );
    let forged = author
        .post("/console/policies/1/rollback", &[("csrf", "0123")])
        .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN);
    let rolled = author
        .post("/console/policies/1/rollback", &[("csrf", &csrf)])
        .await;
    assert_eq!(rolled.location.as_deref(), Some("/console/policies"));
    let (_, status) = server_get(&server, "/v1/policies/status").await;
    assert_eq!(
        (
            status["rollout"]["current"].as_u64(),
            status["rollout"]["latest"].as_u64()
        ),
        (Some(3), Some(3)),
        "only the genuine rollback published: {status}"
    );
    let (_, rolled_back) = server_get(&server, "/v1/policies/3").await;
    let (_, first) = server_get(&server, "/v1/policies/1").await;
    assert_eq!(rolled_back["rules"], first["rules"]);

    let viewer = signed_in(&server, VIEWER).await;
    let seen = viewer.get("/console/policies").await;
    assert!(
        !seen.text.contains("Publish a bundle")
            && !seen.text.contains("Promote")
            && !seen.text.contains("Roll back to")
    );
}

#[tokio::test]
async fn hostile_input_is_escaped_bounded_or_refused() {
    let server = start().await;
    let admin = signed_in(&server, OPERATOR).await;
    let search = admin
        .get("/console/pools?q=%3Cscript%3Ealert(1)%3C%2Fscript%3E")
        .await;
    assert_eq!(search.status, StatusCode::OK);
    assert!(!search.text.contains("<script>alert"), "escaped");
    assert!(search.text.contains("&lt;script&gt;"));
    let paged = admin.get("/console/pools?page=999999999999").await;
    assert_eq!(paged.status, StatusCode::OK);
    let bad_path = admin.get("/console/pools/BAD%20TENANT/api").await;
    assert_eq!(bad_path.status, StatusCode::BAD_REQUEST);
    assert!(
        bad_path.text.contains("<code>tenant</code>"),
        "{}",
        bad_path.text
    );
    let audit = admin
        .get("/console/audit?action=%22%3E%3Cb%3E&text=x")
        .await;
    assert_eq!(audit.status, StatusCode::OK);
    assert!(!audit.text.contains("\"><b>"));

    let csrf = admin.get("/console/pools/new").await.csrf();
    let huge = "9".repeat(100 * 1024);
    let too_big = admin
        .post("/console/pools/new", &pool_form(&csrf, &huge))
        .await;
    assert_eq!(too_big.status, StatusCode::PAYLOAD_TOO_LARGE);
    let garbage = admin
        .request(
            Method::POST,
            "/console/pools/new",
            &[],
            &[
                ("sec-fetch-site", "same-origin"),
                ("content-type", "application/x-www-form-urlencoded"),
            ],
        )
        .await;
    assert_eq!(
        garbage.status,
        StatusCode::FORBIDDEN,
        "no CSRF token in an empty form"
    );
}

#[tokio::test]
async fn the_regions_page_shows_who_leads_each_shard() {
    let server = start().await;
    let viewer = signed_in(&server, VIEWER).await;
    let page = viewer.get("/console/regions").await;
    assert_eq!(page.status, StatusCode::OK);
    let map: allot_shared::wire::ShardMap = server
        .client
        .get(format!("{}/v1/shards", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("shards")
        .json()
        .await
        .expect("a shard map");
    let leader = map.shards[0]
        .leader
        .as_ref()
        .expect("the one allocator leads");
    assert!(
        page.text.contains(r#"<table id="shards">"#),
        "{}",
        page.text
    );
    assert!(
        page.text
            .contains(&format!("<code>{}</code>", leader.node_id)),
        "{}",
        page.text
    );
    assert!(page.text.contains("1 of 1"), "{}", page.text);
}

#[tokio::test]
async fn the_pool_list_pages_and_searches() {
    let server = start().await;
    let body = serde_json::json!({ "limit": 100, "windowMs": 60000, "chunk": 10,
        "leaseTtlMs": 10000, "fallbackPerRegion": 5, "regions": ["eu"] });
    for n in 0..120 {
        let tenant = if n % 2 == 0 { "even" } else { "odd" };
        let response = server
            .client
            .put(format!("{}/v1/pools/{tenant}/p{n:03}", server.url))
            .bearer_auth(OPERATOR)
            .json(&body)
            .send()
            .await
            .expect("put");
        assert_eq!(response.status(), 200);
    }
    let viewer = signed_in(&server, VIEWER).await;
    let rows = |page: &Page| page.text.matches(r#"<a href="/console/pools/"#).count();
    let next_href = |page: &Page| {
        let end = page.text.find(r#"" rel="next""#)?;
        let start = page.text[..end].rfind(r#"href=""#)? + r#"href=""#.len();
        Some(page.text[start..end].replace("&amp;", "&"))
    };
    let first = viewer.get("/console/pools").await;
    assert!(
        first.text.contains("50 pools from the first"),
        "{}",
        first.text
    );
    assert_eq!(rows(&first), 50);
    assert!(first.text.contains(r#"href="/console/pools/even/p098""#));
    assert!(!first.text.contains(r#"rel="first""#));
    // Each page is the API's cursor page: following `next` walks every pool once, in key order.
    let second_href = next_href(&first).expect("a next page");
    assert!(second_href.contains("after=even%2Fp098"), "{second_href}");
    let second = viewer.get(&second_href).await;
    assert_eq!(rows(&second), 50);
    assert!(second.text.contains(r#"href="/console/pools/even/p118""#));
    assert!(second.text.contains(r#"href="/console/pools/odd/p079""#));
    assert!(second.text.contains(r#"rel="first""#));
    let last = viewer.get(&next_href(&second).expect("a third page")).await;
    assert_eq!(rows(&last), 20);
    assert!(
        last.text.contains(r#"href="/console/pools/odd/p119""#),
        "sorted by tenant, then pool"
    );
    assert!(!last.text.contains(r#"href="/console/pools/even/"#));
    assert_eq!(next_href(&last), None, "the last page has no next");
    let odd = viewer.get("/console/pools?q=odd%2Fp1").await;
    assert!(
        odd.text
            .contains("10 pools starting with “odd/p1” from the first"),
        "{}",
        odd.text
    );
    assert_eq!(rows(&odd), 10);
    assert!(odd.text.contains(r#"href="/console/pools/odd/p101""#));
    assert!(!odd.text.contains(r#"href="/console/pools/even/"#));
    let tenant = viewer.get("/console/pools?q=even").await;
    assert_eq!(rows(&tenant), 50, "a tenant prefix reaches its pools");
    let unmatchable = viewer.get("/console/pools?q=no%20such").await;
    assert_eq!(unmatchable.status, StatusCode::OK);
    assert_eq!(rows(&unmatchable), 0);
    assert!(
        unmatchable.text.contains("No pool starts with"),
        "{}",
        unmatchable.text
    );
    let beyond = viewer.get("/console/pools?after=zzz%2Fzzz").await;
    assert_eq!(
        rows(&beyond),
        0,
        "a cursor past the end shows an empty page"
    );
    assert_eq!(next_href(&beyond), None);
}

#[tokio::test]
async fn a_viewer_sees_overrides_in_force_and_ended_by_tenant() {
    let server = start().await;
    let put = server
        .client
        .put(format!("{}/v1/pools/atlas/api", server.url))
        .bearer_auth(OPERATOR)
        .json(
            &serde_json::json!({ "limit": 100, "windowMs": 60_000, "chunk": 10,
                                    "leaseTtlMs": 5_000, "fallbackPerRegion": 0,
                                    "regions": ["eu"] }),
        )
        .send()
        .await
        .expect("pool");
    assert_eq!(put.status(), StatusCode::OK);
    let created: serde_json::Value = server
        .client
        .post(format!("{}/v1/overrides", server.url))
        .bearer_auth(OPERATOR)
        .json(
            &serde_json::json!({ "tenant": "atlas", "pool": "api", "limit": 250,
                                    "reason": "launch week" }),
        )
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    let id = created["id"].as_str().expect("id");
    let viewer = signed_in(&server, VIEWER).await;
    let page = viewer.get("/console/overrides?tenant=atlas").await;
    assert_eq!(page.status, StatusCode::OK);
    for shown in [id, "pool api", "limit 250", "in force", "launch week"] {
        assert!(page.text.contains(shown), "{shown} not on the page");
    }
    assert!(!page.text.contains(r#"<span class="muted">ended</span>"#));
    let other = viewer.get("/console/overrides?tenant=other").await;
    assert!(
        !other.text.contains(id),
        "another tenant's page lists none of atlas's"
    );
    let ended = server
        .client
        .delete(format!("{}/v1/overrides/atlas/{id}", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("end");
    assert_eq!(ended.status(), StatusCode::OK);
    let page = viewer.get("/console/overrides").await;
    assert!(
        page.text.contains(id) && page.text.contains(r#"<span class="muted">ended</span>"#),
        "an ended override stays listed, ended"
    );
}

#[tokio::test]
async fn a_viewer_sees_webhooks_and_their_deliveries_but_never_a_secret() {
    let server = start().await;
    let pool = server
        .client
        .put(format!("{}/v1/pools/atlas/api", server.url))
        .bearer_auth(OPERATOR)
        .json(
            &serde_json::json!({ "limit": 100, "windowMs": 60_000, "chunk": 10,
            "leaseTtlMs": 10_000, "fallbackPerRegion": 0, "regions": ["eu"] }),
        )
        .send()
        .await
        .expect("put pool");
    assert_eq!(pool.status(), 200, "a webhook on one pool needs the pool");
    let created: serde_json::Value = server
        .client
        .post(format!("{}/v1/webhooks", server.url))
        .bearer_auth(OPERATOR)
        .json(
            &serde_json::json!({ "url": "https://billing.example/allot", "tenant": "atlas",
                                   "pool": "api", "thresholdsPct": [90] }),
        )
        .send()
        .await
        .expect("create")
        .json()
        .await
        .expect("json");
    let id = created["id"].as_str().expect("id");
    let secret = created["secret"].as_str().expect("secret");
    let viewer = signed_in(&server, VIEWER).await;
    let page = viewer.get("/console/webhooks").await;
    assert_eq!(page.status, StatusCode::OK);
    for shown in [id, "https://billing.example/allot", "atlas/api", "90 %"] {
        assert!(page.text.contains(shown), "{shown} not on the page");
    }
    assert!(!page.text.contains(secret), "a secret is never on a page");
}

/// A pool's page lists what each agent of a region admitted in fallback, beside the region's
/// allowance; a window whose region's agents together took more is marked.
#[tokio::test]
async fn a_pool_shows_fallback_by_agent() {
    let server = start().await;
    let body = serde_json::json!({ "limit": 100, "windowMs": 3_600_000, "chunk": 10,
        "leaseTtlMs": 10000, "fallbackPerRegion": 6, "regions": ["eu"] });
    let response = server
        .client
        .put(format!("{}/v1/pools/acme/api", server.url))
        .bearer_auth(OPERATOR)
        .json(&body)
        .send()
        .await
        .expect("put");
    assert_eq!(response.status(), 200);
    let now_ms = allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock);
    for (agent, admitted) in [("eu-a", 3), ("eu-b", 5)] {
        let report = serde_json::json!({ "reportId": format!("r-{agent}"), "region": "eu",
            "tenant": "acme", "pool": "api", "windowStartMs": now_ms - now_ms % 3_600_000,
            "fallbackAdmitted": admitted, "agentId": agent });
        let answer = server
            .client
            .post(format!("{}/v1/reports", server.url))
            .bearer_auth(AGENT)
            .json(&report)
            .send()
            .await
            .expect("report");
        assert_eq!(answer.status(), 200);
    }
    let viewer = signed_in(&server, VIEWER).await;
    let live = viewer.get("/console/pools/acme/api/live").await;
    assert_eq!(live.status, StatusCode::OK);
    let table = live
        .text
        .split(r#"id="fallback-by-agent""#)
        .nth(1)
        .expect("the fallback-by-agent table");
    for cell in ["eu-a", "eu-b", ">3<", ">5<", ">6<"] {
        assert!(table.contains(cell), "{cell} in {table}");
    }
    assert!(
        live.text.contains("fallback over the allowance in eu"),
        "8 of 6: {}",
        live.text
    );
}
