//! `shoal ca`, `shoal token add` and `shoal audit`: the cluster's CA and certificates, the
//! HTTP API's tokens, and its audit log (docs/security.md).

use std::path::PathBuf;

use shoal_control::security::{Role, TokenFile};

#[derive(clap::Args)]
pub struct TokenArgs {
    #[command(subcommand)]
    pub command: TokenCommand,
}

#[derive(clap::Subcommand)]
pub enum TokenCommand {
    /// Add a token to a token file (made, mode 0600, if missing). The file keeps only the
    /// token's SHA-256; the token itself is printed once, as the last line.
    Add {
        /// The token file (`[cluster.security] tokens` of the cluster file).
        file: PathBuf,
        /// The holder's name, as the audit log will name them.
        #[arg(long)]
        name: String,
        /// viewer (read), operator (also command and alert) or admin.
        #[arg(long)]
        role: Role,
        /// Accepted for this many days, then refused (401, audited as `expired`); default:
        /// until removed from the file.
        #[arg(long)]
        days: Option<u32>,
    },
    /// Remove a token from a token file: a running run control refuses it at once (it
    /// watches the file) and audits its uses as `revoked`.
    Remove {
        /// The token file.
        file: PathBuf,
        /// The holder's name given at `add`.
        name: String,
    },
}

#[derive(clap::Args)]
pub struct CaArgs {
    #[command(subcommand)]
    pub command: CaCommand,
}

#[derive(clap::Subcommand)]
pub enum CaCommand {
    /// A new cluster CA: DIR/ca.pem and DIR/ca.key (mode 0600). Refuses to replace one.
    Init {
        dir: PathBuf,
        /// The cluster's name, in the CA's subject.
        #[arg(long, default_value = "shoal")]
        cluster: String,
        /// Days the CA is valid.
        #[arg(long, default_value_t = 3650)]
        days: u32,
    },
    /// A certificate and key for one process or tool: DIR/NAME.pem and DIR/NAME.key (0600).
    Issue {
        dir: PathBuf,
        /// The process name (`builder1`), as the cluster file names it.
        name: String,
        /// source, builder, writer, dfm, runcontrol, dispatcher or client (default: the
        /// role NAME starts with).
        #[arg(long)]
        role: Option<String>,
        /// A host name or IP address the process is reached at (repeatable); peers check
        /// the address they connected to against these.
        #[arg(long = "host")]
        hosts: Vec<String>,
        /// Days the certificate is valid.
        #[arg(long, default_value_t = 365)]
        days: u32,
    },
}

pub fn ca(args: CaArgs) -> anyhow::Result<()> {
    use shoal_tls::ca::{ClusterCa, IssueRequest};
    match args.command {
        CaCommand::Init { dir, cluster, days } => {
            ClusterCa::init(&dir, &cluster, days)?;
            eprintln!("cluster CA for {cluster:?}, valid {days} days:");
            println!("{}", dir.join(shoal_tls::ca::CA_CERT).display());
            Ok(())
        }
        CaCommand::Issue { dir, name, role, hosts, days } => {
            let role = match role {
                Some(r) => r,
                None => IssueRequest::role_of(&name)
                    .ok_or_else(|| anyhow::anyhow!("{name:?} starts with no role: give --role"))?
                    .to_string(),
            };
            let ca = ClusterCa::load(&dir)?;
            let (cert, key) = ca.issue_into(&dir, &IssueRequest::new(&name, &role, &hosts, days)?)?;
            eprintln!(
                "{role} certificate for {name:?} ({}), valid {days} days:",
                if hosts.is_empty() { "no hosts".to_string() } else { hosts.join(", ") }
            );
            println!("{} {}", cert.display(), key.display());
            Ok(())
        }
    }
}

#[derive(clap::Args)]
pub struct AuditArgs {
    /// Run control's state directory (`cluster.state_dir`).
    #[arg(long, default_value = "shoal-runs")]
    pub state_dir: PathBuf,
    /// The log's JSON lines as they are.
    #[arg(long)]
    pub json: bool,
}

pub fn token(args: TokenArgs) -> anyhow::Result<()> {
    match args.command {
        TokenCommand::Add { file, name, role, days } => {
            let expires = days.map_or(0, |d| {
                let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.as_secs());
                now + u64::from(d) * 86_400
            });
            let token = TokenFile::add_expiring(&file, &name, role, expires)?;
            eprintln!(
                "added {role} token {name:?} to {} (only its hash is kept; this is the one copy):",
                file.display()
            );
            println!("{token}");
            Ok(())
        }
        TokenCommand::Remove { file, name } => {
            let removed = TokenFile::remove(&file, &name)?;
            eprintln!("removed {} token {name:?} from {}", removed.role, file.display());
            Ok(())
        }
    }
}

pub fn audit(args: AuditArgs) -> anyhow::Result<()> {
    shoal_control::audit::print(&args.state_dir, args.json)
}
