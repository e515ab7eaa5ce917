//! The worker's thread: the only place that touches UCX handles.
//!
//! Every callback UCX makes (send and receive completions, active messages, endpoint
//! errors) runs inside `ucp_worker_progress` on this thread, so the state they reach is
//! plain thread-local data and boxed operations whose ownership passes to UCX with the
//! request and back in the callback.

#![allow(unsafe_code)]
// The casts say which C type a field takes: bindgen gives UCX's enum constants the
// enum's underlying type, which is not the same for every enum, version and platform.
#![allow(clippy::unnecessary_cast)]

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, c_void};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{debug, info, warn};
use ucx_sys::*;

use crate::region::{Region, Slot};
use crate::{Command, Message, Receive, Sink, UcxError, WorkerStats};

thread_local! {
    /// Operations handed to UCX and not yet completed: while any are, the loop also
    /// wakes on a short tick, since not every transport's progress raises the event
    /// descriptor.
    static OUTSTANDING: Cell<usize> = const { Cell::new(0) };
}

/// Empty progress rounds a worker spins through while operations are in flight before it
/// waits on its event descriptor (a few microseconds). Short: on a host with fewer cores
/// than busy threads a spinning worker holds the core its peer needs (256 rounds cost a
/// third of the goodput at 6 sources to one builder on 2 cores, 16 none measurable).
const SPIN: u32 = 16;

/// How long the thread waits at its end for closing endpoints and operations in flight.
const END_WAIT: Duration = Duration::from_secs(2);

fn status_error(call: &'static str, status: ucs_status_t) -> UcxError {
    // SAFETY: ucs_status_string returns a static string for any status value.
    let s = unsafe { CStr::from_ptr(ucs_status_string(status)) };
    UcxError::Status { call, status: s.to_string_lossy().into_owned() }
}

/// `UCS_PTR_IS_ERR`, `UCS_PTR_STATUS`: a request pointer that is really a status.
fn ptr_status(p: ucs_status_ptr_t) -> Option<ucs_status_t> {
    let v = p as isize;
    (v < 0 && v >= UCS_ERR_LAST as isize).then_some(v as ucs_status_t)
}

/// `ucp_dt_make_contig(1)`: bytes.
const DATATYPE_BYTES: ucp_datatype_t = (1 << 3) | UCP_DATATYPE_CONTIG as ucp_datatype_t;

struct Efd(RawFd);

impl AsRawFd for Efd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// The process's UCX context, shared by its workers (`mt_workers_shared`: UCX locks what
/// they share). One context per worker cost the embedded full shape (101 workers) most of
/// its time in the memory-event hooks, where UCX calls every context's handler under one
/// global lock at each `mmap`/`munmap` of the process; one context has one handler, one
/// configuration read and one set of transport resources.
struct Context(ucp_context_h);

// SAFETY: created with `mt_workers_shared`, the context may be used by workers on
// different threads; it is released once, by the last holder (`Drop`).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker of it is destroyed (each holds the context until it is).
        unsafe { ucp_cleanup(self.0) };
    }
}

impl Context {
    /// The process's context: the one its workers hold, or a new one if none is alive.
    fn shared() -> Result<Arc<Context>, UcxError> {
        static SHARED: std::sync::Mutex<std::sync::Weak<Context>> = std::sync::Mutex::new(std::sync::Weak::new());
        let mut shared = SHARED.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = shared.upgrade() {
            return Ok(c);
        }
        let c = Arc::new(Context::new()?);
        *shared = Arc::downgrade(&c);
        Ok(c)
    }

    fn new() -> Result<Context, UcxError> {
        // SAFETY: UCX's documented order (read the configuration from the environment,
        // init a context); every out-pointer is a local.
        unsafe {
            let mut config: *mut ucp_config_t = ptr::null_mut();
            let s = ucp_config_read(ptr::null(), ptr::null(), &mut config);
            if s != UCS_OK {
                return Err(status_error("ucp_config_read", s));
            }
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask =
                (UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED) as u64;
            params.features = (UCP_FEATURE_AM | UCP_FEATURE_WAKEUP) as u64;
            params.name = c"shoal".as_ptr();
            params.mt_workers_shared = 1;
            let mut context: ucp_context_h = ptr::null_mut();
            let s = ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut context);
            ucp_config_release(config);
            if s != UCS_OK {
                return Err(status_error("ucp_init", s));
            }
            Ok(Context(context))
        }
    }
}

/// The UCX objects of one thread, released in reverse order on drop.
struct Ucx {
    context: Arc<Context>,
    worker: ucp_worker_h,
    /// The receive region's registration (null: none).
    memh: ucp_mem_h,
}

impl Drop for Ucx {
    fn drop(&mut self) {
        // SAFETY: the worker and the registration were created by `Ucx::new` and
        // `Ucx::map` and are released once, the worker (and what it has in flight) first;
        // the context goes with its last worker.
        unsafe {
            ucp_worker_destroy(self.worker);
            if !self.memh.is_null() {
                ucp_mem_unmap(self.context.0, self.memh);
            }
        }
    }
}

impl Ucx {
    fn new() -> Result<Ucx, UcxError> {
        let context = Context::shared()?;
        // SAFETY: a live context; the out-pointer is a local.
        unsafe {
            let mut wparams: ucp_worker_params_t = std::mem::zeroed();
            wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64;
            wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
            let mut worker: ucp_worker_h = ptr::null_mut();
            let s = ucp_worker_create(context.0, &wparams, &mut worker);
            if s != UCS_OK {
                return Err(status_error("ucp_worker_create", s));
            }
            Ok(Ucx { context, worker, memh: ptr::null_mut() })
        }
    }

    /// Registers the receive region once: rendezvous payloads land in it without UCX
    /// registering (on RDMA: pinning) each buffer on its own.
    fn map(&mut self, region: &Region) -> Result<(), UcxError> {
        // SAFETY: the region's memory lives longer than the registration (the region is
        // held by every slot and by the thread, which unmaps before it lets go).
        unsafe {
            let mut p: ucp_mem_map_params_t = std::mem::zeroed();
            p.field_mask = (UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | UCP_MEM_MAP_PARAM_FIELD_PROT) as u64;
            p.address = region.base() as *mut c_void;
            p.length = region.len();
            p.prot = (UCP_MEM_MAP_PROT_LOCAL_READ
                | UCP_MEM_MAP_PROT_LOCAL_WRITE
                | UCP_MEM_MAP_PROT_REMOTE_READ
                | UCP_MEM_MAP_PROT_REMOTE_WRITE) as u32;
            let s = ucp_mem_map(self.context.0, &p, &mut self.memh);
            if s != UCS_OK {
                self.memh = ptr::null_mut();
                return Err(status_error("ucp_mem_map", s));
            }
        }
        Ok(())
    }

    fn address(&self) -> Result<Bytes, UcxError> {
        // SAFETY: the address UCX returns is copied, then released to the same worker.
        unsafe {
            let mut addr: *mut ucp_address_t = ptr::null_mut();
            let mut len = 0usize;
            let s = ucp_worker_get_address(self.worker, &mut addr, &mut len);
            if s != UCS_OK {
                return Err(status_error("ucp_worker_get_address", s));
            }
            let bytes = Bytes::copy_from_slice(std::slice::from_raw_parts(addr as *const u8, len));
            ucp_worker_release_address(self.worker, addr);
            Ok(bytes)
        }
    }

    fn efd(&self) -> Result<RawFd, UcxError> {
        let mut fd = -1;
        // SAFETY: a live worker created with UCP_FEATURE_WAKEUP.
        let s = unsafe { ucp_worker_get_efd(self.worker, &mut fd) };
        if s != UCS_OK {
            return Err(status_error("ucp_worker_get_efd", s));
        }
        Ok(fd)
    }

    /// Progresses until nothing more happens at once.
    fn progress(&self) {
        // SAFETY: a live worker, on the thread that owns it.
        while unsafe { ucp_worker_progress(self.worker) } != 0 {}
    }

    /// Progresses while operations are in flight, for at most `SPIN` empty rounds in a
    /// row: a rendezvous's next step (the peer's fetch, its acknowledgement) usually comes
    /// within microseconds, sooner than a wake-up through the event descriptor would.
    fn progress_spinning(&self) {
        let mut idle = 0;
        while idle < SPIN && OUTSTANDING.with(Cell::get) > 0 {
            // SAFETY: as above.
            if unsafe { ucp_worker_progress(self.worker) } != 0 {
                idle = 0;
            } else {
                idle += 1;
                std::hint::spin_loop();
            }
        }
    }

    /// True once the event descriptor is armed (nothing pending: wait on it).
    fn arm(&self) -> bool {
        // SAFETY: as above.
        unsafe { ucp_worker_arm(self.worker) != UCS_ERR_BUSY }
    }
}

/// What a receive handler needs: the worker (for `ucp_am_recv_data_nbx`), the sink, the
/// counters, the region and its registration, the receives waiting for room in it; one
/// per worker thread, reached from each id's [`Handler`].
struct Receiving {
    worker: ucp_worker_h,
    sink: Sink,
    stats: Arc<WorkerStats>,
    region: Option<Arc<Region>>,
    memh: ucp_mem_h,
    /// Rendezvous receives waiting for room, in the order they came: UCX holds their
    /// senders' operations (and so their windows) until they are posted.
    deferred: VecDeque<Deferred>,
}

impl Receiving {
    /// The ids to handle and their receiving state (leaked: freed by hand at the end).
    fn new(
        ucx: &Ucx,
        receive: Option<Receive>,
        region: Option<Arc<Region>>,
        stats: Arc<WorkerStats>,
    ) -> (Vec<u16>, *mut Receiving) {
        let (ids, sink) = match receive {
            Some(r) => (r.ids, r.sink),
            None => (Vec::new(), Box::new(|_| {}) as Sink),
        };
        let r = Receiving { worker: ucx.worker, sink, stats, region, memh: ucx.memh, deferred: VecDeque::new() };
        (ids, Box::into_raw(Box::new(r)))
    }
}

/// A rendezvous kept (the callback returned `UCS_INPROGRESS`) until the region has room.
struct Deferred {
    id: u16,
    header: Bytes,
    desc: *mut c_void,
    length: usize,
}

/// Where a rendezvous payload lands.
enum Target {
    Slot(Slot),
    Heap(Vec<u8>),
}

/// The argument of one active-message id's handler.
struct Handler {
    id: u16,
    receiving: *mut Receiving,
}

/// A rendezvous receive in flight: the buffer the data lands in.
struct ReceiveOp {
    id: u16,
    header: Bytes,
    target: Target,
    receiving: *mut Receiving,
}

/// A send in flight: the buffers UCX reads until it completes.
struct SendOp {
    _header: Bytes,
    _data: Vec<Bytes>,
    _iov: Vec<ucp_dt_iov>,
    done: oneshot::Sender<Result<(), UcxError>>,
    stats: Arc<WorkerStats>,
    bytes: u64,
}

impl SendOp {
    fn finish(self, status: ucs_status_t) {
        if status == UCS_OK {
            self.stats.messages_sent.fetch_add(1, Ordering::Relaxed);
            self.stats.bytes_sent.fetch_add(self.bytes, Ordering::Relaxed);
            let _ = self.done.send(Ok(()));
        } else {
            self.stats.send_errors.fetch_add(1, Ordering::Relaxed);
            let _ = self.done.send(Err(status_error("ucp_am_send_nbx", status)));
        }
    }
}

/// An endpoint's error handler argument: where its failure is told.
struct EndpointState {
    failed: watch::Sender<Option<UcxError>>,
    stats: Arc<WorkerStats>,
}

unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: `arg` is the endpoint's boxed state, kept until its close completes.
    let state = unsafe { &*(arg as *const EndpointState) };
    state.stats.endpoint_failures.fetch_add(1, Ordering::Relaxed);
    let _ = state.failed.send(Some(status_error("endpoint", status)));
}

unsafe extern "C" fn on_send(request: *mut c_void, status: ucs_status_t, user_data: *mut c_void) {
    // SAFETY: `user_data` is the SendOp boxed by `send`; UCX calls this once.
    let op = unsafe { *Box::from_raw(user_data as *mut SendOp) };
    op.finish(status);
    OUTSTANDING.with(|o| o.set(o.get().saturating_sub(1)));
    // SAFETY: a request UCX returned, freed once, after its completion.
    unsafe { ucp_request_free(request) };
}

unsafe extern "C" fn on_receive_data(
    request: *mut c_void,
    status: ucs_status_t,
    length: usize,
    user_data: *mut c_void,
) {
    // SAFETY: `user_data` is the ReceiveOp boxed by `on_message`; UCX calls this once.
    let op = unsafe { *Box::from_raw(user_data as *mut ReceiveOp) };
    finish_receive(op, status, length);
    OUTSTANDING.with(|o| o.set(o.get().saturating_sub(1)));
    // SAFETY: as in `on_send`.
    unsafe { ucp_request_free(request) };
}

fn finish_receive(op: ReceiveOp, status: ucs_status_t, length: usize) {
    // SAFETY: the Receiving outlives every operation of its worker (dropped after the
    // worker is destroyed).
    let r = unsafe { &mut *op.receiving };
    let ReceiveOp { id, header, target, .. } = op;
    let data = if status == UCS_OK {
        r.stats.messages_received.fetch_add(1, Ordering::Relaxed);
        r.stats.rendezvous_received.fetch_add(1, Ordering::Relaxed);
        r.stats.bytes_received.fetch_add(length as u64, Ordering::Relaxed);
        Ok(match target {
            Target::Slot(slot) => slot.into_bytes(length),
            Target::Heap(mut buffer) => {
                // SAFETY: UCX wrote `length` bytes (at most the capacity it was given).
                unsafe { buffer.set_len(length.min(buffer.capacity())) };
                Bytes::from(buffer)
            }
        })
    } else {
        r.stats.receive_errors.fetch_add(1, Ordering::Relaxed);
        Err(status_error("ucp_am_recv_data_nbx", status))
    };
    (r.sink)(Message { id, header, data, rendezvous: true });
}

unsafe extern "C" fn on_message(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the id's Handler, alive as long as the worker; the header and an
    // eager payload are valid for the duration of this call.
    let (handler, header, attr) = unsafe {
        let h = &*(arg as *const Handler);
        let header = if header_length == 0 {
            Bytes::new()
        } else {
            Bytes::copy_from_slice(std::slice::from_raw_parts(header as *const u8, header_length))
        };
        (h, header, (*param).recv_attr)
    };
    // SAFETY: as in `finish_receive`.
    let r = unsafe { &mut *handler.receiving };
    if attr & UCP_AM_RECV_ATTR_FLAG_RNDV as u64 == 0 {
        // Eager: the data is UCX's until this returns; small, so it is copied (into the
        // region when it has room at once).
        let bytes = if length == 0 {
            Bytes::new()
        } else {
            // SAFETY: `length` bytes at `data`, valid during this call.
            let eager = unsafe { std::slice::from_raw_parts(data as *const u8, length) };
            match r.region.as_ref().and_then(|g| g.take(length, false)) {
                Some(slot) => slot.fill(eager),
                None => Bytes::copy_from_slice(eager),
            }
        };
        r.stats.messages_received.fetch_add(1, Ordering::Relaxed);
        r.stats.bytes_received.fetch_add(length as u64, Ordering::Relaxed);
        (r.sink)(Message { id: handler.id, header, data: Ok(bytes), rendezvous: false });
        return UCS_OK;
    }
    // Rendezvous: the payload is fetched into a slot of the region (or, without one, a
    // buffer of its own), from which the frame is taken without another copy. While the
    // region is full the receive waits, in order behind those already waiting.
    let target = match &r.region {
        Some(region) if length <= region.len() => {
            match r.deferred.is_empty().then(|| region.take(length, true)).flatten() {
                Some(slot) => Target::Slot(slot),
                None => {
                    r.stats.receives_deferred.fetch_add(1, Ordering::Relaxed);
                    r.deferred.push_back(Deferred { id: handler.id, header, desc: data, length });
                    return UCS_INPROGRESS;
                }
            }
        }
        _ => {
            r.stats.received_outside_region.fetch_add(1, Ordering::Relaxed);
            Target::Heap(Vec::with_capacity(length))
        }
    };
    post_receive(handler.receiving, handler.id, header, data, length, target);
    UCS_OK
}

/// Starts fetching a rendezvous payload into `target`.
fn post_receive(receiving: *mut Receiving, id: u16, header: Bytes, desc: *mut c_void, length: usize, target: Target) {
    // SAFETY: as in `finish_receive`.
    let r = unsafe { &mut *receiving };
    let memh = match target {
        Target::Slot(_) => r.memh,
        Target::Heap(_) => ptr::null_mut(),
    };
    let mut op = Box::new(ReceiveOp { id, header, target, receiving });
    let dest = match &mut op.target {
        Target::Slot(slot) => slot.as_mut_ptr() as *mut c_void,
        Target::Heap(buffer) => buffer.as_mut_ptr() as *mut c_void,
    };
    let op = Box::into_raw(op);
    // SAFETY: a zeroed parameter block is valid with only the masked fields set; the
    // ReceiveOp (and its buffer) passes to UCX until the callback or an immediate result;
    // `desc` is a rendezvous descriptor UCX handed to `on_message`, used once.
    unsafe {
        let mut p: ucp_request_param_t = std::mem::zeroed();
        p.op_attr_mask = (UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE) as u32;
        p.cb.recv_am = Some(on_receive_data);
        p.user_data = op as *mut c_void;
        p.datatype = DATATYPE_BYTES;
        if !memh.is_null() {
            p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH as u32;
            p.memh = memh;
        }
        let req = ucp_am_recv_data_nbx(r.worker, desc, dest, length, &p);
        if req.is_null() {
            finish_receive(*Box::from_raw(op), UCS_OK, length);
        } else if let Some(s) = ptr_status(req) {
            finish_receive(*Box::from_raw(op), s, 0);
        } else {
            OUTSTANDING.with(|o| o.set(o.get() + 1));
        }
    }
}

/// Posts the waiting receives the region now has room for, in order.
fn post_deferred(receiving: *mut Receiving) {
    loop {
        // SAFETY: as in `finish_receive`; no reference is held across `post_receive`.
        let r = unsafe { &mut *receiving };
        let (Some(region), Some(front)) = (r.region.clone(), r.deferred.front()) else {
            return;
        };
        let Some(slot) = region.take(front.length, true) else {
            return;
        };
        let d = r.deferred.pop_front().expect("front above");
        post_receive(receiving, d.id, d.header, d.desc, d.length, Target::Slot(slot));
    }
}

/// Whether receives wait for room.
fn has_deferred(receiving: *mut Receiving) -> bool {
    // SAFETY: as in `finish_receive`.
    !unsafe { &*receiving }.deferred.is_empty()
}

/// An open endpoint, and how many [`crate::Endpoint`]s use it.
struct EndpointEntry {
    ep: ucp_ep_h,
    state: Box<EndpointState>,
    remote: Vec<u8>,
    users: usize,
}

/// The worker's open endpoints, one per peer worker address: every connection of this
/// process to the same peer shares it (the messages' own headers say which connection
/// they are for). The embedded full shape's source links (7,500 to 100 builders) had an
/// endpoint each: UCX's progress walked thousands of endpoints' pending queues and each
/// builder answered 75 wire-ups.
#[derive(Default)]
struct Endpoints {
    by_id: HashMap<u64, EndpointEntry>,
    /// The well endpoint to each address (a failed one is not handed out again).
    by_remote: HashMap<Vec<u8>, u64>,
    next_id: u64,
}

impl Endpoints {
    /// An endpoint to `remote`: the open one to it, or a new one.
    fn connect(
        &mut self,
        ucx: &Ucx,
        remote: Vec<u8>,
        stats: &Arc<WorkerStats>,
    ) -> Result<(u64, watch::Receiver<Option<UcxError>>), UcxError> {
        if let Some(&id) = self.by_remote.get(&remote) {
            let e = self.by_id.get_mut(&id).expect("by_remote names open endpoints");
            if e.state.failed.borrow().is_none() {
                e.users += 1;
                return Ok((id, e.state.failed.subscribe()));
            }
            // Failed: its users still hold it until they close; a new connection gets a
            // new endpoint (the peer may be back at the same address).
            self.by_remote.remove(&remote);
        }
        let (failed, failed_rx) = watch::channel(None);
        let state = Box::new(EndpointState { failed, stats: stats.clone() });
        let ep = connect(ucx, &remote, &state)?;
        stats.endpoints_created.fetch_add(1, Ordering::Relaxed);
        self.next_id += 1;
        self.by_remote.insert(remote.clone(), self.next_id);
        self.by_id.insert(self.next_id, EndpointEntry { ep, state, remote, users: 1 });
        Ok((self.next_id, failed_rx))
    }

    /// One user of `id` is done with it. A failed endpoint is closed with its last user;
    /// a well one stays open without users (for the next connection to its peer, and so
    /// that what its last user left in flight can still complete) until the worker ends.
    fn release(&mut self, id: u64, closing: &mut Vec<Closing>) {
        let Some(e) = self.by_id.get_mut(&id) else {
            return;
        };
        e.users -= 1;
        if e.users > 0 || e.state.failed.borrow().is_none() {
            return;
        }
        let e = self.by_id.remove(&id).expect("just seen");
        if self.by_remote.get(&e.remote) == Some(&id) {
            self.by_remote.remove(&e.remote);
        }
        close(e, true, closing);
    }

    fn get(&self, id: u64) -> Option<ucp_ep_h> {
        self.by_id.get(&id).map(|e| e.ep)
    }

    /// Every endpoint, for the worker's end.
    fn drain(&mut self) -> impl Iterator<Item = EndpointEntry> + '_ {
        self.by_remote.clear();
        self.by_id.drain().map(|(_, e)| e)
    }
}

struct Closing {
    request: *mut c_void,
    state: Box<EndpointState>,
}

/// Starts the thread; returns the worker's address once it is up, or why it is not.
pub(crate) fn spawn(
    name: &str,
    receive: Option<Receive>,
    region: Option<Arc<Region>>,
    commands: mpsc::UnboundedReceiver<Command>,
    stats: Arc<WorkerStats>,
) -> Result<Bytes, UcxError> {
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let name = name.to_string();
    let thread = std::thread::Builder::new()
        .name(format!("ucx-{name}"))
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(UcxError::Status { call: "tokio runtime", status: e.to_string() }));
                    return;
                }
            };
            rt.block_on(run(name, receive, region, commands, stats, ready_tx));
        })
        .map_err(|e| UcxError::Status { call: "thread", status: e.to_string() })?;
    crate::exit::track(thread);
    match ready.recv() {
        Ok(Ok(address)) => Ok(address),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(UcxError::WorkerGone),
    }
}

/// Registers `on_message` for each id, its argument a [`Handler`] reaching `receiving`.
fn set_handlers(ucx: &Ucx, ids: &[u16], receiving: *mut Receiving) -> Result<Vec<*mut Handler>, UcxError> {
    let handlers: Vec<*mut Handler> =
        ids.iter().map(|&id| Box::into_raw(Box::new(Handler { id, receiving }))).collect();
    for &h in &handlers {
        // SAFETY: the handler argument lives until after the worker is destroyed.
        let s = unsafe {
            let mut p: ucp_am_handler_param_t = std::mem::zeroed();
            p.field_mask = (UCP_AM_HANDLER_PARAM_FIELD_ID
                | UCP_AM_HANDLER_PARAM_FIELD_CB
                | UCP_AM_HANDLER_PARAM_FIELD_ARG
                | UCP_AM_HANDLER_PARAM_FIELD_FLAGS) as u64;
            p.id = (*h).id as u32;
            p.flags = UCP_AM_FLAG_WHOLE_MSG as u32;
            p.cb = Some(on_message);
            p.arg = h as *mut c_void;
            ucp_worker_set_am_recv_handler(ucx.worker, &p)
        };
        if s != UCS_OK {
            return Err(status_error("ucp_worker_set_am_recv_handler", s));
        }
    }
    Ok(handlers)
}

async fn run(
    name: String,
    receive: Option<Receive>,
    region: Option<Arc<Region>>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    stats: Arc<WorkerStats>,
    ready: std::sync::mpsc::Sender<Result<Bytes, UcxError>>,
) {
    let registered = Ucx::new().and_then(|mut u| {
        if let Some(region) = &region {
            u.map(region)?;
        }
        Ok(u)
    });
    let ucx = match registered {
        Ok(u) => u,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    // Raw pointers, freed by hand once the worker is destroyed: until then a callback
    // may reach them.
    let (ids, receiving) = Receiving::new(&ucx, receive, region.clone(), stats.clone());
    let handlers = match set_handlers(&ucx, &ids, receiving) {
        Ok(h) => h,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let efd = match ucx.efd().and_then(|fd| {
        // SAFETY: the descriptor is the worker's, open until `ucx` is dropped, which
        // happens after `efd` is (below).
        unsafe { AsyncFd::register_with_interest(Efd(fd), tokio::io::Interest::READABLE) }
            .map_err(|e| UcxError::Status { call: "AsyncFd", status: e.into_parts().1.to_string() })
    }) {
        Ok(f) => f,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    match ucx.address() {
        Ok(a) => {
            let _ = ready.send(Ok(a));
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    }
    let mut endpoints = Endpoints::default();
    let mut closing: Vec<Closing> = Vec::new();
    loop {
        // Every command waiting is taken before the worker progresses: sends queued
        // together go out together.
        let mut ended = false;
        loop {
            match commands.try_recv() {
                Ok(c) => handle(&ucx, c, &mut endpoints, &mut closing, &stats),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    ended = true;
                    break;
                }
            }
        }
        if ended || crate::exit::stopping() {
            break;
        }
        ucx.progress();
        ucx.progress_spinning();
        reap(&mut closing);
        if !ucx.arm() {
            // Events came in while arming, or UCX has work pending (a send waiting for room
            // in the peer's queue): progress again before waiting, but first give the core
            // away, since what UCX waits for is most often another thread of this host (the
            // peer draining its queue). Spinning here took the core from that thread: at 6
            // sources to a builder with 64 kB fragments it halved goodput on 2 cores.
            std::thread::yield_now();
            tokio::task::yield_now().await;
            continue;
        }
        let busy = OUTSTANDING.with(Cell::get) > 0 || !closing.is_empty();
        let waiting_for_room = has_deferred(receiving);
        let room = async {
            match &region {
                Some(r) => r.room().await,
                None => std::future::pending().await,
            }
        };
        // Enabled before the flag is read, so that a stop between the two still wakes it.
        let mut stop = std::pin::pin!(crate::exit::STOP.notified());
        stop.as_mut().enable();
        if crate::exit::stopping() {
            break;
        }
        tokio::select! {
            _ = stop => break,
            _ = room, if waiting_for_room => post_deferred(receiving),
            c = commands.recv() => match c {
                Some(c) => handle(&ucx, c, &mut endpoints, &mut closing, &stats),
                None => break,
            },
            g = efd.readable() => {
                if let Ok(mut g) = g {
                    g.clear_ready();
                }
            }
            _ = tokio::time::sleep(Duration::from_micros(200)), if busy => {}
        }
    }
    end_wait(&ucx, &mut endpoints, &mut closing, &name).await;
    drop(efd);
    release_deferred(&ucx, receiving);
    let states = release(closing);
    drop(ucx);
    drop(states);
    // SAFETY: the worker is destroyed: no callback can reach these any more.
    unsafe {
        for h in handlers {
            drop(Box::from_raw(h));
        }
        drop(Box::from_raw(receiving));
    }
}

/// The worker's end before its destruction: what is in flight finishes first (bounded: a
/// send completes once its peer has fetched it). Then every endpoint is closed, what is
/// still in flight cancelled (forced): a peer that has not fetched it by then will not
/// (gone, or it released the message unread at its own end) and a flush would never end.
/// UCX cancels them where it tracks requests per endpoint (peer-failure mode); over
/// shared memory alone it cannot, and warns at the worker's destruction that they were
/// "not returned to mpool".
async fn end_wait(ucx: &Ucx, endpoints: &mut Endpoints, closing: &mut Vec<Closing>, name: &str) {
    let in_flight = || OUTSTANDING.with(Cell::get) > 0;
    progress_while(ucx, closing, |_| in_flight()).await;
    let force = in_flight();
    for e in endpoints.drain() {
        let failed = e.state.failed.borrow().is_some();
        close(e, force || failed, closing);
    }
    progress_while(ucx, closing, |closing| !closing.is_empty() || in_flight()).await;
    if !closing.is_empty() || in_flight() {
        debug!(worker = %name, closing = closing.len(), "UCX operations still in flight at the worker's end");
    }
}

/// Progresses (reaping completed closes) while `busy`, for at most [`END_WAIT`].
async fn progress_while(ucx: &Ucx, closing: &mut Vec<Closing>, busy: impl Fn(&[Closing]) -> bool) {
    let deadline = std::time::Instant::now() + END_WAIT;
    while busy(closing) && std::time::Instant::now() < deadline {
        ucx.progress();
        reap(closing);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn handle(
    ucx: &Ucx,
    command: Command,
    endpoints: &mut Endpoints,
    closing: &mut Vec<Closing>,
    stats: &Arc<WorkerStats>,
) {
    match command {
        Command::Connect { remote, reply } => {
            let _ = reply.send(endpoints.connect(ucx, remote, stats));
        }
        Command::Send { endpoint, id, header, data, done } => match endpoints.get(endpoint) {
            Some(ep) => send(ep, id, header, data, done, stats),
            None => {
                let _ = done.send(Err(UcxError::WorkerGone));
            }
        },
        Command::Close { endpoint } => endpoints.release(endpoint, closing),
    }
}

/// UCX checks little of an address it is given; shoal's come from its own peers over an
/// authenticated connection, and a too-short one is refused here.
const MIN_ADDRESS_LEN: usize = 8;

fn connect(ucx: &Ucx, remote: &[u8], state: &EndpointState) -> Result<ucp_ep_h, UcxError> {
    if remote.len() < MIN_ADDRESS_LEN {
        return Err(UcxError::Status { call: "ucp_ep_create", status: format!("a {}-byte address", remote.len()) });
    }
    // Shared memory alone (`UCX_TLS=posix,self`, as inside many containers) has no
    // peer-failure detection, and UCX refuses the mode (logging errors of its own on
    // stdout) rather than pretend: such a transport list gets endpoints without it.
    // shoal's TCP connection beside each endpoint watches the peer either way.
    let tls = std::env::var("UCX_TLS").unwrap_or_default();
    let mode = if peer_failure_possible(&tls) { UCP_ERR_HANDLING_MODE_PEER } else { UCP_ERR_HANDLING_MODE_NONE };
    if mode == UCP_ERR_HANDLING_MODE_NONE && !PEER_MODE_REFUSED.with(|r| r.replace(true)) {
        info!(
            tls,
            "these UCX transports cannot detect a failed peer: endpoints without it, the TCP \
             connection beside each watches its peer"
        );
    }
    match create_endpoint(ucx, remote, state, mode) {
        // A list this check did not know: UCX found no transport for the mode.
        Err(UCS_ERR_UNREACHABLE) if mode == UCP_ERR_HANDLING_MODE_PEER => {
            create_endpoint(ucx, remote, state, UCP_ERR_HANDLING_MODE_NONE)
                .map_err(|s| status_error("ucp_ep_create", s))
        }
        other => other.map_err(|s| status_error("ucp_ep_create", s)),
    }
}

/// Whether `UCX_TLS` (empty: UCX's default, every transport) leaves a transport that
/// carries active messages and detects a failed peer: anything but shared memory (posix,
/// sysv, xpmem, knem; cma and knem carry no active messages at all, only rendezvous
/// data) and the loop-back `self`.
fn peer_failure_possible(tls: &str) -> bool {
    const WITHOUT: [&str; 9] = ["posix", "sysv", "xpmem", "knem", "cma", "self", "mm", "shm", "sm"];
    let tls = tls.trim();
    tls.is_empty() || tls.starts_with('^') || tls.split(',').any(|t| !WITHOUT.contains(&t.trim()))
}

thread_local! {
    /// Said once per worker thread: the transports refused peer-failure handling.
    static PEER_MODE_REFUSED: Cell<bool> = const { Cell::new(false) };
}

fn create_endpoint(
    ucx: &Ucx,
    remote: &[u8],
    state: &EndpointState,
    mode: ucp_err_handling_mode_t,
) -> Result<ucp_ep_h, ucs_status_t> {
    // SAFETY: the address is read during the call; the error handler's argument lives
    // until the endpoint's close completes (`Closing`).
    unsafe {
        let mut p: ucp_ep_params_t = std::mem::zeroed();
        p.field_mask = (UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
            | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
            | UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64;
        p.address = remote.as_ptr() as *const ucp_address_t;
        p.err_mode = mode;
        p.err_handler = ucp_err_handler { cb: Some(on_endpoint_error), arg: state as *const _ as *mut c_void };
        let mut ep: ucp_ep_h = ptr::null_mut();
        let s = ucp_ep_create(ucx.worker, &p, &mut ep);
        if s != UCS_OK {
            return Err(s);
        }
        Ok(ep)
    }
}

fn send(
    ep: ucp_ep_h,
    id: u16,
    header: Bytes,
    data: Vec<Bytes>,
    done: oneshot::Sender<Result<(), UcxError>>,
    stats: &Arc<WorkerStats>,
) {
    let data: Vec<Bytes> = data.into_iter().filter(|b| !b.is_empty()).collect();
    let bytes: u64 = data.iter().map(|b| b.len() as u64).sum();
    let iov: Vec<ucp_dt_iov> =
        data.iter().map(|b| ucp_dt_iov { buffer: b.as_ptr() as *mut c_void, length: b.len() }).collect();
    let op = Box::new(SendOp { _header: header, _data: data, _iov: iov, done, stats: stats.clone(), bytes });
    let (hptr, hlen) = (op._header.as_ptr(), op._header.len());
    let (buffer, count, datatype) = match op._iov.len() {
        0 => (ptr::null(), 0, DATATYPE_BYTES),
        1 => (op._iov[0].buffer as *const c_void, op._iov[0].length, DATATYPE_BYTES),
        n => (op._iov.as_ptr() as *const c_void, n, UCP_DATATYPE_IOV as ucp_datatype_t),
    };
    let op = Box::into_raw(op);
    // SAFETY: the header, the payload parts and the iovec live in the SendOp, which UCX
    // holds until the callback (or which is taken back at once on an immediate result).
    unsafe {
        let mut p: ucp_request_param_t = std::mem::zeroed();
        p.op_attr_mask = (UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE) as u32;
        p.cb.send = Some(on_send);
        p.user_data = op as *mut c_void;
        p.datatype = datatype;
        let req = ucp_am_send_nbx(ep, id as u32, hptr as *const c_void, hlen, buffer, count, &p);
        if req.is_null() {
            (*Box::from_raw(op)).finish(UCS_OK);
        } else if let Some(s) = ptr_status(req) {
            (*Box::from_raw(op)).finish(s);
        } else {
            OUTSTANDING.with(|o| o.set(o.get() + 1));
        }
    }
}

fn close(e: EndpointEntry, force: bool, closing: &mut Vec<Closing>) {
    // SAFETY: an endpoint this worker created, closed once.
    let req = unsafe {
        let mut p: ucp_request_param_t = std::mem::zeroed();
        p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS as u32;
        p.flags = if force { UCP_EP_CLOSE_FLAG_FORCE as u32 } else { 0 };
        ucp_ep_close_nbx(e.ep, &p)
    };
    if req.is_null() {
        return;
    }
    if let Some(s) = ptr_status(req) {
        if s != UCS_ERR_CANCELED && s != UCS_ERR_ENDPOINT_TIMEOUT && s != UCS_ERR_CONNECTION_RESET {
            warn!(status = %status_error("ucp_ep_close_nbx", s), "closing a UCX endpoint");
        }
        return;
    }
    closing.push(Closing { request: req, state: e.state });
}

/// Hands the close requests not completed back to UCX (`ucp_request_free` on one in
/// flight releases it when it completes or with the worker): destroying a worker with a
/// request its user never released aborts in UCX (`ucp_ep.c`, seen with 30,000 endpoints
/// closing at a full-shape demo's end). Returns their failure states, which UCX's error
/// callback may still reach until the worker is gone.
// Boxed: UCX holds each state's address (its error callback's argument), so it must not move.
#[allow(clippy::vec_box)]
fn release(closing: Vec<Closing>) -> Vec<Box<EndpointState>> {
    closing
        .into_iter()
        .map(|c| {
            // SAFETY: a request from `ucp_ep_close_nbx`, not yet freed; freed once here.
            unsafe { ucp_request_free(c.request) };
            c.state
        })
        .collect()
}

/// Releases the rendezvous descriptors kept for room and never posted.
fn release_deferred(ucx: &Ucx, receiving: *mut Receiving) {
    // SAFETY: descriptors UCX handed to `on_message` and never posted, each released once;
    // the Receiving lives until after the worker is destroyed.
    unsafe {
        for d in (*receiving).deferred.drain(..) {
            ucp_am_data_release(ucx.worker, d.desc);
        }
    }
}

/// Frees the close requests that have completed.
fn reap(closing: &mut Vec<Closing>) {
    closing.retain(|c| {
        // SAFETY: a request from `ucp_ep_close_nbx`, not yet freed.
        let s = unsafe { ucp_request_check_status(c.request) };
        if s == UCS_INPROGRESS {
            return true;
        }
        // SAFETY: completed, freed once.
        unsafe { ucp_request_free(c.request) };
        false
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn shared_memory_alone_is_known_to_have_no_peer_failure_detection() {
        use super::peer_failure_possible as p;
        assert!(p("") && p("tcp") && p("tcp,cma,posix,self") && p("^cma") && p("rc_mlx5,self"));
        assert!(!p("posix,self") && !p("sysv") && !p(" posix , self ") && !p("cma,posix,self") && !p("shm,self"));
    }
}
