//! `shoal token add` and `shoal audit`: the HTTP API's tokens and its audit log
//! (docs/security.md).

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
    },
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
        TokenCommand::Add { file, name, role } => {
            let token = TokenFile::add(&file, &name, role)?;
            eprintln!(
                "added {role} token {name:?} to {} (only its hash is kept; this is the one copy):",
                file.display()
            );
            println!("{token}");
            Ok(())
        }
    }
}

pub fn audit(args: AuditArgs) -> anyhow::Result<()> {
    shoal_control::audit::print(&args.state_dir, args.json)
}
