//! `shoal filter-worker`: runs a C filter plug-in out of the builder's process
//! (`builder.filter.isolate = true`, docs/plugins.md). Started by a builder with its socket
//! as fd 3; not for use by hand.

use shoal_trigger::{Filter, FilterConfig};

#[derive(clap::Args)]
pub struct FilterWorkerArgs {
    /// The plug-in's shared library.
    #[arg(long)]
    plugin: String,
    /// Text for the plug-in's init.
    #[arg(long, default_value = "")]
    config: String,
}

pub fn run(args: FilterWorkerArgs) -> anyhow::Result<std::process::ExitCode> {
    let cfg = FilterConfig { plugin: args.plugin, config: args.config, ..FilterConfig::default() };
    // An init that fails is said on stderr (the builder's log) and the worker ends before
    // its hello: the builder refuses the run with that pointer.
    let mut filter: Box<dyn Filter> = shoal_trigger::build(&cfg)?;
    shoal_shm::workers::serve(|slice| {
        let (failed, refused) = (filter.failed_slices(), filter.malformed_events());
        let events = filter.process(slice);
        if filter.failed_slices() > failed {
            return Err(());
        }
        Ok((events, filter.malformed_events() - refused))
    })?;
    filter.cleanup();
    Ok(std::process::ExitCode::SUCCESS)
}
