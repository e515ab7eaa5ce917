//! ControlHost (KM3NeT "Ligier" dialect): the message dispatcher's protocol and routing,
//! sans-IO. Specification: `docs/controlhost.md` (from the design notes' `controlhost.md`).
//!
//! - [`codec`]: [`Tag`], the 16-byte prefix, [`MessageDecoder`] for byte streams.
//! - [`access`]: [`CommandAccess`], which publishers may send command tags (`RC_CMD`,
//!   `ALERT`): by their address, since the protocol carries no credential.
//! - [`subscription`]: the lenient `_Subscri` grammar.
//! - [`router`]: the dispatcher's state machine ([`Router`]): subscriptions (replace
//!   semantics), readiness (`_Always`, `_Gime`), nicknames (`_MyId`, `_UniqueI`, `Born`,
//!   `Died`), fan-out in arrival order including the sender, lossy `w` (any) with a
//!   per-client queue limit, lossless `a` (all) with a global memory limit and back-pressure.

pub mod access;
pub mod codec;
pub mod router;
pub mod subscription;

pub use access::{CommandAccess, IpNet};
pub use codec::{CodecError, Message, MessageDecoder, PREFIX_LEN, Tag, encode_prefix};
pub use router::{ClientId, CloseReason, Output, Router, RouterConfig};
pub use subscription::{Mode, Subscription, parse_subscription};
