//! Where deliveries may go. A webhook's author names the URL and the allocator posts to it from
//! inside the operator's network, then reports each attempt's error: without a rule, an author
//! could reach (and, through the errors, map) loopback, private and link-local services. So unless
//! the operator allows private addresses (`--webhook-allow-private`), a delivery goes only to
//! public ones:
//! - a URL naming an address is refused at registration and again at every delivery;
//! - a URL naming a host is resolved at every delivery by [`PublicOnly`], which hands the client
//!   only the public addresses it resolved to (the client connects to those, so a name that
//!   changes its address between a check and the connection cannot slip through);
//! - redirects are not followed (a 3xx is a failed attempt), so none can lead elsewhere.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Why an address is not for deliveries, or `None` for a public one.
pub fn private_kind(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => private_kind_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => private_kind_v4(v4),
            None => private_kind_v6(v6),
        },
    }
}

fn private_kind_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [first, second, ..] = ip.octets();
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_private() {
        Some("private")
    } else if ip.is_link_local() {
        Some("link-local")
    } else if first == 100 && (64..128).contains(&second) {
        // 100.64.0.0/10, carrier-grade NAT: shared, not public.
        Some("shared (carrier-grade NAT)")
    } else if ip.is_unspecified() || first == 0 {
        Some("unspecified")
    } else if ip.is_broadcast() || ip.is_multicast() {
        Some("broadcast or multicast")
    } else if (first == 198 && (18..20).contains(&second))
        || (first == 192 && second == 0 && ip.octets()[2] == 0)
        || first >= 240
    {
        // 198.18.0.0/15 (benchmarking), 192.0.0.0/24 (protocol assignments), 240.0.0.0/4.
        Some("reserved")
    } else {
        None
    }
}

fn private_kind_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let segments = ip.segments();
    // NAT64 (64:ff9b::/96) reaches the IPv4 address in its last 32 bits: judged as that address.
    if segments[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        let [.., a, b, c, d] = ip.octets();
        return private_kind_v4(Ipv4Addr::new(a, b, c, d));
    }
    if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_unique_local() {
        Some("unique-local")
    } else if ip.is_unicast_link_local() {
        Some("link-local")
    } else if segments[0] & 0xffc0 == 0xfec0 {
        Some("site-local")
    } else if ip.is_unspecified() {
        Some("unspecified")
    } else if ip.is_multicast() {
        Some("multicast")
    } else {
        None
    }
}

/// Why `url` may not be delivered to because it names a non-public address, or `None` (a public
/// address, or a host name, which [`PublicOnly`] checks when it is resolved).
pub fn literal_refusal(url: &reqwest::Url) -> Option<String> {
    // A URL's IPv6 host is written in brackets; a name does not parse as an address.
    let host = url.host_str()?;
    let ip: IpAddr = host
        .strip_prefix('[')
        .and_then(|inner| inner.strip_suffix(']'))
        .unwrap_or(host)
        .parse()
        .ok()?;
    private_kind(ip).map(|kind| {
        format!(
            "names a {kind} address; deliveries go to public addresses only, unless the allocator \
             runs with --webhook-allow-private"
        )
    })
}

/// The resolver of the delivery client: every address a name resolves to, less the non-public
/// ones; a name with none left fails to resolve.
#[derive(Debug, Clone, Copy, Default)]
pub struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let public: Vec<SocketAddr> = resolved
                .iter()
                .copied()
                .filter(|address| private_kind(address.ip()).is_none())
                .collect();
            if public.is_empty() {
                let kinds: Vec<&str> = resolved
                    .iter()
                    .filter_map(|address| private_kind(address.ip()))
                    .collect();
                let error: Box<dyn std::error::Error + Send + Sync> = format!(
                    "{host} resolves to no public address ({}); deliveries go to public \
                     addresses only, unless the allocator runs with --webhook-allow-private",
                    if kinds.is_empty() {
                        "none at all".to_owned()
                    } else {
                        kinds.join(", ")
                    }
                )
                .into();
                return Err(error);
            }
            let addresses: reqwest::dns::Addrs = Box::new(public.into_iter());
            Ok(addresses)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_non_public_range_is_named_and_public_addresses_pass() {
        for (address, kind) in [
            ("127.0.0.1", "loopback"),
            ("127.255.0.9", "loopback"),
            ("10.1.2.3", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("169.254.169.254", "link-local"),
            ("100.64.0.1", "shared (carrier-grade NAT)"),
            ("0.0.0.0", "unspecified"),
            ("::1", "loopback"),
            ("fd00::1", "unique-local"),
            ("fc00::1", "unique-local"),
            ("fe80::1", "link-local"),
            ("::", "unspecified"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:10.0.0.1", "private"),
            ("64:ff9b::7f00:1", "loopback"),
            ("64:ff9b::a9fe:a9fe", "link-local"),
            ("fec0::1", "site-local"),
            ("198.18.0.1", "reserved"),
            ("192.0.0.8", "reserved"),
            ("240.0.0.1", "reserved"),
        ] {
            let ip: IpAddr = address.parse().expect("address");
            assert_eq!(private_kind(ip), Some(kind), "{address}");
        }
        for public in [
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "64:ff9b::808:808",
            "198.20.0.1",
            "192.0.2.1",
        ] {
            let ip: IpAddr = public.parse().expect("address");
            assert_eq!(private_kind(ip), None, "{public}");
        }
    }

    #[test]
    fn a_url_naming_a_private_address_is_refused_and_a_name_is_left_to_resolution() {
        let refused = |url: &str| literal_refusal(&reqwest::Url::parse(url).expect("url"));
        assert!(refused("https://127.0.0.1:8443/hook").is_some());
        assert!(refused("https://[::1]/hook").is_some());
        assert!(refused("https://[fe80::1]/hook").is_some());
        assert!(refused("https://169.254.169.254/latest").is_some());
        assert!(refused("https://8.8.8.8/hook").is_none());
        assert!(refused("https://localhost/hook").is_none());
        assert!(refused("https://hooks.example/hook").is_none());
    }

    #[tokio::test]
    async fn a_name_resolving_only_to_loopback_resolves_to_nothing() {
        use reqwest::dns::Resolve;
        let name: reqwest::dns::Name = "localhost".parse().expect("name");
        let error = match PublicOnly.resolve(name).await {
            Ok(addresses) => panic!("localhost resolved to {:?}", addresses.collect::<Vec<_>>()),
            Err(error) => error.to_string(),
        };
        assert!(error.contains("no public address"), "{error}");
        assert!(error.contains("loopback"), "{error}");
    }
}
