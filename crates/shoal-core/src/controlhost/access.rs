//! Who may publish commands through the dispatcher.
//!
//! ControlHost has no field for a credential, and KM3NeT's clients (km3pipe, the
//! `controlhost` package, Jpp) must keep working on the plain port. What the dispatcher
//! can know is where a message comes from: [`CommandAccess`] lets a publisher's message
//! through when its tag does not command anyone, or when its address is in the allowed
//! networks. Subscribing and every other tag are untouched.

use std::net::IpAddr;

use super::Tag;

/// Tags whose messages make processes act: run control's commands (`RC_CMD`, also
/// KM3NeT run control's tag) and external alerts (`ALERT`: every builder saves raw data).
pub const COMMAND_TAGS: [&str; 2] = ["RC_CMD", "ALERT"];

/// An IP network: an address and how many of its leading bits count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpNet {
    addr: IpAddr,
    prefix: u8,
}

impl IpNet {
    /// Whether `ip` is in the network (an IPv4 address mapped into IPv6 counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, unmapped(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

impl std::str::FromStr for IpNet {
    type Err = String;
    /// `ADDRESS/PREFIX`, or an address alone (the host: /32 or /128).
    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| format!("{s:?} is not an address or ADDRESS/PREFIX"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p.parse::<u8>().ok().filter(|&p| p <= max).ok_or_else(|| format!("{s:?}: prefix 0 to {max}"))?,
        };
        // An IPv4 network written as IPv4-mapped IPv6 (`::ffff:a.b.c.d/120`) is that IPv4
        // network, its prefix counted in the IPv4 bits; a shorter prefix reaches beyond the
        // mapped range and stays an IPv6 network. (Found by the `security` fuzz target: the
        // mapped address with its IPv6 prefix overflowed the IPv4 mask.)
        match (addr, unmapped(addr)) {
            (IpAddr::V6(_), IpAddr::V4(v4)) if prefix >= 96 => Ok(IpNet { addr: IpAddr::V4(v4), prefix: prefix - 96 }),
            _ => Ok(IpNet { addr, prefix }),
        }
    }
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Which publishers may send command tags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommandAccess {
    tags: Vec<Tag>,
    allowed: Vec<IpNet>,
}

impl Default for CommandAccess {
    /// Commands from this host only (loopback).
    fn default() -> Self {
        Self::new(vec![IpNet::loopback_v4(), IpNet::loopback_v6()])
    }
}

impl IpNet {
    pub fn loopback_v4() -> Self {
        "127.0.0.0/8".parse().expect("a valid network")
    }

    pub fn loopback_v6() -> Self {
        "::1/128".parse().expect("a valid network")
    }
}

impl CommandAccess {
    /// Command tags ([`COMMAND_TAGS`]) only from `allowed`.
    pub fn new(allowed: Vec<IpNet>) -> Self {
        let tags = COMMAND_TAGS.iter().map(|t| Tag::new(t.as_bytes()).expect("a valid tag")).collect();
        Self { tags, allowed }
    }

    /// Whether a message of `tag` published from `from` may go on.
    pub fn allows(&self, tag: &Tag, from: IpAddr) -> bool {
        !self.tags.contains(tag) || self.allowed.iter().any(|n| n.contains(from))
    }

    pub fn allowed(&self) -> &[IpNet] {
        &self.allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_contain_what_their_prefix_covers() {
        let n: IpNet = "198.19.254.0/24".parse().unwrap();
        assert!(n.contains(ip("198.19.254.2")) && !n.contains(ip("198.19.253.2")));
        assert!(n.contains(ip("::ffff:198.19.254.9")), "an IPv4-mapped address is IPv4");
        let host: IpNet = "127.0.0.2".parse().unwrap();
        assert!(host.contains(ip("127.0.0.2")) && !host.contains(ip("127.0.0.1")));
        let all: IpNet = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("203.0.113.5")) && !all.contains(ip("::1")));
        assert!(IpNet::loopback_v6().contains(ip("::1")));
        assert!("127.0.0.1/33".parse::<IpNet>().is_err());
        assert!("localhost".parse::<IpNet>().is_err());
        assert_eq!("192.0.2.3/24".parse::<IpNet>().unwrap().to_string(), "192.0.2.3/24");
        let mapped: IpNet = "::ffff:192.0.2.1/120".parse().unwrap();
        assert_eq!(mapped.to_string(), "192.0.2.1/24", "an IPv4-mapped network is the IPv4 one");
        assert!(mapped.contains(ip("192.0.2.200")) && !mapped.contains(ip("192.0.3.1")));
        let wide: IpNet = "::ffff:0.0.0.0/80".parse().unwrap();
        assert!(!wide.contains(ip("192.0.2.1")), "a prefix beyond the mapped range stays IPv6");
    }

    #[test]
    fn command_tags_come_only_from_allowed_addresses_and_other_tags_from_anyone() {
        let access = CommandAccess::default();
        let rc = Tag::new(b"RC_CMD").unwrap();
        let alert = Tag::new(b"ALERT").unwrap();
        let data = Tag::new(b"IO_EVT").unwrap();
        assert!(access.allows(&rc, ip("127.0.0.1")) && access.allows(&alert, ip("::1")));
        assert!(!access.allows(&rc, ip("192.0.2.7")) && !access.allows(&alert, ip("192.0.2.7")));
        assert!(access.allows(&data, ip("192.0.2.7")), "data tags are anyone's");
        let only = CommandAccess::new(vec!["127.0.0.2/32".parse().unwrap()]);
        assert!(!only.allows(&rc, ip("127.0.0.1")) && only.allows(&rc, ip("127.0.0.2")));
    }
}
