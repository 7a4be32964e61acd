//! The program's hook (`on_program_init`): Envoy's log for the core's
//! `log` calls, the panic hook, the fault switch (test builds only), and
//! the library pinned in memory.

use std::ffi::c_char;

use super::guard;
use crate::abi::{self, ModuleBuffer};

/// Envoy's log, for the core's `log` calls.
struct EnvoyLog;

fn level(l: log::Level) -> abi::LogLevel {
    match l {
        log::Level::Error => abi::LOG_ERROR,
        log::Level::Warn => abi::LOG_WARN,
        log::Level::Info => abi::LOG_INFO,
        log::Level::Debug | log::Level::Trace => abi::LOG_DEBUG,
    }
}

impl log::Log for EnvoyLog {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        // SAFETY: callable from any thread.
        unsafe { abi::envoy_dynamic_module_callback_log_enabled(level(metadata.level())) }
    }

    fn log(&self, record: &log::Record<'_>) {
        if self.enabled(record.metadata()) {
            let text = record.args().to_string();
            // SAFETY: as above; the message is ours for the call.
            unsafe {
                abi::envoy_dynamic_module_callback_log(
                    level(record.level()),
                    ModuleBuffer::of(text.as_bytes()),
                )
            }
        }
    }

    fn flush(&self) {}
}

static LOG: EnvoyLog = EnvoyLog;

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const c_char {
    guard(|| {
        if log::set_logger(&LOG).is_ok() {
            log::set_max_level(log::LevelFilter::Info);
        }
        std::panic::set_hook(Box::new(|info| {
            log::error!("tenantgate: panic caught at the module's boundary: {info}");
        }));
        #[cfg(feature = "test-faults")]
        crate::fault::init();
        pin();
        abi::ABI_VERSION_C.as_ptr()
    })
    .unwrap_or(std::ptr::null())
}

/// `Dl_info` (glibc `<dlfcn.h>`).
#[repr(C)]
struct DlInfo {
    fname: *const c_char,
    fbase: *mut std::ffi::c_void,
    sname: *const c_char,
    saddr: *mut std::ffi::c_void,
}

unsafe extern "C" {
    fn dladdr(addr: *const std::ffi::c_void, info: *mut DlInfo) -> i32;
    fn dlopen(filename: *const c_char, flags: i32) -> *mut std::ffi::c_void;
}

/// glibc's `RTLD_LAZY | RTLD_NOLOAD | RTLD_NODELETE`.
const PIN_FLAGS: i32 = 0x0001 | 0x0004 | 0x1000;

/// Keeps the library mapped for the life of the process, whatever Envoy's
/// config says (`do_not_close`): its tick thread and its process-memory
/// state must never outlive its code. A second `dlopen` of ourselves with
/// `RTLD_NODELETE` makes a later `dlclose` leave it loaded.
fn pin() {
    let mut info = DlInfo {
        fname: std::ptr::null(),
        fbase: std::ptr::null_mut(),
        sname: std::ptr::null(),
        saddr: std::ptr::null_mut(),
    };
    let here = envoy_dynamic_module_on_program_init as *const std::ffi::c_void;
    // SAFETY: plain libc calls with our own pointers.
    let pinned = unsafe {
        dladdr(here, &mut info) != 0 && !info.fname.is_null() && !dlopen(info.fname, PIN_FLAGS).is_null()
    };
    if !pinned {
        log::warn!("tenantgate: cannot pin the module in memory: set do_not_close in its config");
    }
}
