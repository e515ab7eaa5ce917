//! `shoal alert`: sends an external alert to every builder through the dispatcher and
//! prints what each builder saved.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use shoal_core::Instant;
use shoal_core::alert::{ALERT_REPLY_TAG, ALERT_TAG, Alert, parse_unix_seconds};
use shoal_core::controlhost::Mode;
use shoal_core::saver::AlertReport;
use shoal_dispatcher::client::ChClient;

#[derive(clap::Parser)]
pub struct AlertArgs {
    /// The dispatcher the builders listen to.
    #[arg(long, default_value = "127.0.0.1:5553")]
    dispatcher: std::net::SocketAddr,
    /// Window start: UNIX seconds (e.g. 1795406400.25), `now`, or `now-25s` / `now+5s`.
    #[arg(long, allow_hyphen_values = true)]
    from: String,
    /// Window end (exclusive), in the same forms.
    #[arg(long, allow_hyphen_values = true)]
    to: String,
    /// The alert's name (1-64 of A-Z a-z 0-9 _ . : + -).
    #[arg(long)]
    name: String,
    /// Who raises it.
    #[arg(long, default_value = "shoal-alert")]
    origin: String,
    /// Wait this many answers (one per builder), then stop; 0: wait the whole `--wait`.
    #[arg(long, default_value_t = 0)]
    expect: usize,
    /// Most seconds to wait for the builders' answers.
    #[arg(long, default_value_t = 10.0)]
    wait: f64,
    /// A secured cluster's dispatcher: a directory with ca.pem, NAME.pem and NAME.key of a
    /// certificate with the `client` (or `runcontrol`) role (`shoal ca issue DIR NAME --role
    /// client`); without it the alert goes in plain ControlHost, which a secured dispatcher
    /// takes only from `command_from` (docs/security.md).
    #[arg(long, value_name = "DIR")]
    credentials: Option<std::path::PathBuf>,
    /// The certificate's name in --credentials.
    #[arg(long, default_value = "alert")]
    cert_name: String,
}

/// Reads `now`, `now-25s`, `now+2.5s` or UNIX seconds, as UNIX nanoseconds.
pub fn parse_time(text: &str, now_ns: u64) -> anyhow::Result<u64> {
    let bad = || anyhow::anyhow!("{text:?}: expected UNIX seconds, `now`, `now-25s` or `now+5s`");
    let Some(rest) = text.strip_prefix("now") else {
        return parse_unix_seconds(text).ok_or_else(bad);
    };
    if rest.is_empty() {
        return Ok(now_ns);
    }
    let (sign, num) = rest.split_at(1);
    let secs: f64 = num.strip_suffix('s').unwrap_or(num).parse().map_err(|_| bad())?;
    if !(secs.is_finite() && secs >= 0.0) {
        return Err(bad());
    }
    let d = (secs * 1e9) as u64;
    match sign {
        "-" => now_ns.checked_sub(d).ok_or_else(bad),
        "+" => now_ns.checked_add(d).ok_or_else(bad),
        _ => Err(bad()),
    }
}

pub async fn command(args: AlertArgs) -> anyhow::Result<ExitCode> {
    let now = shoal_net::clock::WallClock::new().now().as_nanos();
    let from = parse_time(&args.from, now).context("--from")?;
    let to = parse_time(&args.to, now).context("--to")?;
    let alert = Alert::new(&args.name, Instant::from_nanos(from), Instant::from_nanos(to), &args.origin)?;
    let tls = match &args.credentials {
        Some(dir) => {
            let id = shoal_tls::Identity::load(&shoal_tls::Credentials::in_dir(dir, &args.cert_name))
                .with_context(|| format!("--credentials {}", dir.display()))?;
            Some(shoal_dispatcher::client::ControlTls::new(&id)?)
        }
        None => None,
    };
    let mut client = ChClient::connect_with(args.dispatcher, tls)
        .await
        .with_context(|| format!("connecting to the dispatcher at {}", args.dispatcher))?;
    client.subscribe(ALERT_REPLY_TAG, Mode::All).await?;
    // The dispatcher handles one connection's messages in order: the subscription is in
    // place before the alert is routed, so no answer can be missed.
    client.publish(ALERT_TAG, alert.encode().as_bytes()).await?;
    eprintln!("sent ALERT {alert}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs_f64(args.wait.max(0.0));
    let (mut answers, mut errors) = (0usize, 0usize);
    loop {
        let msg = tokio::select! {
            m = client.next_message() => m?,
            _ = tokio::time::sleep_until(deadline) => break,
        };
        if msg.tag.name() != ALERT_REPLY_TAG.as_bytes() {
            continue;
        }
        match serde_json::from_slice::<AlertReport>(&msg.payload) {
            Ok(r) if r.name == alert.name && r.from_ns == from && r.to_ns == to => {
                println!("{}", r.describe());
                answers += 1;
            }
            Ok(_) => continue, // another alert's answer
            Err(_) => {
                // A refusal: {"name": process, "error": reason}.
                println!("{}", String::from_utf8_lossy(&msg.payload));
                errors += 1;
                answers += 1;
            }
        }
        if args.expect > 0 && answers >= args.expect {
            break;
        }
    }
    if answers == 0 {
        eprintln!("no builder answered within {} s", args.wait);
        return Ok(ExitCode::from(2));
    }
    Ok(if errors == 0 { ExitCode::SUCCESS } else { ExitCode::from(2) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_read_as_documented() {
        let now = 1_000_000_000_000;
        assert_eq!(parse_time("now", now).unwrap(), now);
        assert_eq!(parse_time("now-25s", now).unwrap(), now - 25_000_000_000);
        assert_eq!(parse_time("now+0.5", now).unwrap(), now + 500_000_000);
        assert_eq!(parse_time("12.5", now).unwrap(), 12_500_000_000);
        for bad in ["now*3", "now-x", "yesterday", "now-inf", ""] {
            assert!(parse_time(bad, now).is_err(), "{bad}");
        }
    }
}
