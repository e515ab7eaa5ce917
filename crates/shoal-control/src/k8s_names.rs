//! The names `launch = "k8s"` gives Kubernetes objects ([`pod_name`]), and the rules they
//! must follow: checked when the cluster file is read (crate::cluster) and used by the
//! session (crate::k8s).

use anyhow::bail;

/// A name Kubernetes takes for an object (RFC 1123 label: lower-case letters, digits and
/// `-`, starting and ending with a letter or digit, at most 63).
fn dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A label value (at most 63 of letters, digits, `-`, `_`, `.`, starting and ending with
/// a letter or digit).
fn label_value(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
}

/// The Pod of `process` of `cluster` in session `run` (`attempt` > 0: its restarts):
/// `<cluster>-<process>-<run>`, lower case, `_` as `-`.
pub fn pod_name(cluster: &str, process: &str, run: &str, attempt: u32) -> anyhow::Result<String> {
    let mut name = format!("{cluster}-{process}-{run}").to_ascii_lowercase().replace('_', "-");
    if attempt > 0 {
        name += &format!("-r{attempt}");
    }
    if !dns_label(&name) {
        bail!(
            "the Pod name {name:?} (cluster.name-process-run) is not a Kubernetes name: lower-case letters, digits \
             and '-', at most 63"
        );
    }
    if !label_value(cluster) || !label_value(process) {
        bail!("cluster {cluster:?} and process {process:?} must be Kubernetes label values (letters, digits, -_.)");
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_names_are_kubernetes_names() {
        assert_eq!(pod_name("Sector_A", "source0", "0a1b2c3d", 0).unwrap(), "sector-a-source0-0a1b2c3d");
        assert_eq!(pod_name("s", "source0", "0a1b2c3d", 2).unwrap(), "s-source0-0a1b2c3d-r2");
        assert!(pod_name("s", &"x".repeat(60), "0a1b2c3d", 0).is_err());
        assert!(pod_name("s", "a.b", "0a1b2c3d", 0).is_err());
        assert!(pod_name("s", "a/b", "0a1b2c3d", 0).is_err());
    }
}
