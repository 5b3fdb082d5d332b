//! The HIP runtime (`libamdhip64.so`), opened with libloading: the function
//! table the ROCm driver calls, and HIP's error codes.
//!
//! Nothing is linked at build time, so the crate builds without ROCm. The
//! library is opened once per process ([`Hip::get`]); `ARBOR_HIP_LIB` names
//! a `libamdhip64.so*` file (or its folder) outside the loader's paths. Only
//! functions whose C prototypes are the same in ROCm 5.x and 6.x are bound;
//! the device-properties struct, whose layout changed in 6.0, is read through
//! [`Hip::props_layout`].

#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Serializes runtime initialization with hiprtc compiles: in ROCm 5.x
/// hiprtc lives in the HIP runtime library, and a compile racing the
/// runtime's first initialization on another thread crashes the process.
pub static INIT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `hipError_t`.
pub type HipError = c_int;
pub const HIP_SUCCESS: HipError = 0;
pub const HIP_ERROR_OUT_OF_MEMORY: HipError = 2;
pub const HIP_ERROR_NO_DEVICE: HipError = 100;

/// `hipStreamNonBlocking`.
pub const STREAM_NON_BLOCKING: c_uint = 1;
/// `hipMemcpyHostToDevice` of `hipMemcpyKind`.
pub const MEMCPY_HOST_TO_DEVICE: c_int = 1;
/// `hipHostMallocPortable`.
pub const HOST_MALLOC_PORTABLE: c_uint = 1;
/// `hipEventDisableTiming`.
pub const EVENT_DISABLE_TIMING: c_uint = 2;
/// `hipStreamCaptureModeThreadLocal`.
pub const CAPTURE_MODE_THREAD_LOCAL: c_int = 1;
/// `hipDeviceAttributeMultiprocessorCount` (same value in ROCm 5 and 6).
pub const ATTR_MULTIPROCESSOR_COUNT: c_int = 63;
/// `hipDeviceAttributeMaxSharedMemoryPerBlock`.
pub const ATTR_MAX_SHARED_MEMORY_PER_BLOCK: c_int = 74;
/// `hipDeviceAttributeWarpSize`.
pub const ATTR_WARP_SIZE: c_int = 87;

pub type Stream = *mut c_void;
pub type Event = *mut c_void;
pub type Module = *mut c_void;
pub type Function = *mut c_void;
pub type GraphT = *mut c_void;
pub type GraphExec = *mut c_void;

/// Where `gcnArchName` lies in the device-properties struct of the symbol found.
#[derive(Clone, Copy, Debug)]
pub struct PropsLayout {
    pub arch_name_offset: usize,
}

/// `hipDeviceProp_tR0600` (ROCm 6+) is 1472 bytes with `gcnArchName` at 1160;
/// the ROCm 5 `hipDeviceProp_t` (also what 6.x's plain symbol fills) is 792
/// bytes with it at 396. Buffers passed are larger than either.
pub const PROPS_BUFFER: usize = 4096;

macro_rules! hip_api {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*) -> $ret:ty; )*) => {
        /// The bound HIP runtime functions.
        pub struct Hip {
            $( pub $field: unsafe extern "C" fn($($arg),*) -> $ret, )*
            /// `hipGetDevicePropertiesR0600` (6.x) or `hipGetDeviceProperties` (5.x).
            pub get_device_properties: unsafe extern "C" fn(*mut c_void, c_int) -> HipError,
            pub props_layout: PropsLayout,
            /// The file opened.
            pub path: String,
            _lib: libloading::Library,
        }

        impl Hip {
            fn bind(lib: libloading::Library, path: String) -> Result<Self, String> {
                // SAFETY: each symbol is looked up by its C name and given the
                // prototype of ROCm's headers (identical in ROCm 5.x and 6.x).
                unsafe {
                    $( let $field = *lib
                        .get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!($sym, "\0").as_bytes())
                        .map_err(|e| format!("{path}: no {}: {e}", $sym))?; )*
                    let (get_device_properties, props_layout) = match lib
                        .get::<unsafe extern "C" fn(*mut c_void, c_int) -> HipError>(b"hipGetDevicePropertiesR0600\0")
                    {
                        Ok(f) => (*f, PropsLayout { arch_name_offset: 1160 }),
                        Err(_) => (
                            *lib.get::<unsafe extern "C" fn(*mut c_void, c_int) -> HipError>(b"hipGetDeviceProperties\0")
                                .map_err(|e| format!("{path}: no hipGetDeviceProperties: {e}"))?,
                            PropsLayout { arch_name_offset: 396 },
                        ),
                    };
                    Ok(Self { $($field,)* get_device_properties, props_layout, path, _lib: lib })
                }
            }
        }
    };
}

hip_api! {
    init = "hipInit": fn(c_uint) -> HipError;
    get_device_count = "hipGetDeviceCount": fn(*mut c_int) -> HipError;
    set_device = "hipSetDevice": fn(c_int) -> HipError;
    device_get_name = "hipDeviceGetName": fn(*mut c_char, c_int, c_int) -> HipError;
    device_total_mem = "hipDeviceTotalMem": fn(*mut usize, c_int) -> HipError;
    device_get_attribute = "hipDeviceGetAttribute": fn(*mut c_int, c_int, c_int) -> HipError;
    mem_get_info = "hipMemGetInfo": fn(*mut usize, *mut usize) -> HipError;
    malloc = "hipMalloc": fn(*mut *mut c_void, usize) -> HipError;
    free = "hipFree": fn(*mut c_void) -> HipError;
    host_malloc = "hipHostMalloc": fn(*mut *mut c_void, usize, c_uint) -> HipError;
    host_free = "hipHostFree": fn(*mut c_void) -> HipError;
    stream_create_with_flags = "hipStreamCreateWithFlags": fn(*mut Stream, c_uint) -> HipError;
    stream_destroy = "hipStreamDestroy": fn(Stream) -> HipError;
    stream_synchronize = "hipStreamSynchronize": fn(Stream) -> HipError;
    event_create_with_flags = "hipEventCreateWithFlags": fn(*mut Event, c_uint) -> HipError;
    event_record = "hipEventRecord": fn(Event, Stream) -> HipError;
    event_destroy = "hipEventDestroy": fn(Event) -> HipError;
    stream_wait_event = "hipStreamWaitEvent": fn(Stream, Event, c_uint) -> HipError;
    memcpy_htod_async = "hipMemcpyHtoDAsync": fn(*mut c_void, *mut c_void, usize, Stream) -> HipError;
    memcpy_2d_async = "hipMemcpy2DAsync": fn(
        *mut c_void, usize, *const c_void, usize, usize, usize, c_int, Stream
    ) -> HipError;
    memcpy_dtoh_async = "hipMemcpyDtoHAsync": fn(*mut c_void, *mut c_void, usize, Stream) -> HipError;
    memcpy_dtod_async = "hipMemcpyDtoDAsync": fn(*mut c_void, *mut c_void, usize, Stream) -> HipError;
    memset_d8_async = "hipMemsetD8Async": fn(*mut c_void, u8, usize, Stream) -> HipError;
    module_load_data = "hipModuleLoadData": fn(*mut Module, *const c_void) -> HipError;
    module_get_function = "hipModuleGetFunction": fn(*mut Function, Module, *const c_char) -> HipError;
    module_unload = "hipModuleUnload": fn(Module) -> HipError;
    module_launch_kernel = "hipModuleLaunchKernel": fn(
        Function, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Stream,
        *mut *mut c_void, *mut *mut c_void
    ) -> HipError;
    stream_begin_capture = "hipStreamBeginCapture": fn(Stream, c_int) -> HipError;
    stream_end_capture = "hipStreamEndCapture": fn(Stream, *mut GraphT) -> HipError;
    graph_instantiate = "hipGraphInstantiate": fn(*mut GraphExec, GraphT, *mut *mut c_void, *mut c_char, usize) -> HipError;
    graph_launch = "hipGraphLaunch": fn(GraphExec, Stream) -> HipError;
    graph_exec_destroy = "hipGraphExecDestroy": fn(GraphExec) -> HipError;
    graph_destroy = "hipGraphDestroy": fn(GraphT) -> HipError;
    get_error_name = "hipGetErrorName": fn(HipError) -> *const c_char;
    runtime_get_version = "hipRuntimeGetVersion": fn(*mut c_int) -> HipError;
}

/// Library files to try, in order.
fn candidates() -> Result<Vec<PathBuf>, String> {
    const NAMES: [&str; 4] = [
        "libamdhip64.so",
        "libamdhip64.so.7",
        "libamdhip64.so.6",
        "libamdhip64.so.5",
    ];
    if let Some(p) = std::env::var_os("ARBOR_HIP_LIB") {
        let p = PathBuf::from(p);
        if !p.is_dir() {
            return Ok(vec![p]);
        }
        let found: Vec<PathBuf> = NAMES
            .iter()
            .map(|n| p.join(n))
            .filter(|f| f.exists())
            .collect();
        if found.is_empty() {
            return Err(format!(
                "ARBOR_HIP_LIB={}: no libamdhip64.so* in it",
                p.display()
            ));
        }
        return Ok(found);
    }
    let mut v: Vec<PathBuf> = NAMES.iter().map(PathBuf::from).collect();
    v.extend(NAMES.iter().map(|n| PathBuf::from("/opt/rocm/lib").join(n)));
    Ok(v)
}

impl Hip {
    /// The HIP runtime of this process, or why it cannot be loaded.
    pub fn get() -> Result<&'static Hip, String> {
        static HIP: OnceLock<Result<Hip, String>> = OnceLock::new();
        HIP.get_or_init(|| {
            let mut errors = Vec::new();
            for c in candidates()? {
                // SAFETY: loading the HIP runtime runs only its initializers.
                match unsafe { libloading::Library::new(&c) } {
                    Ok(lib) => return Hip::bind(lib, c.display().to_string()),
                    Err(e) => errors.push(e.to_string()),
                }
            }
            Err(format!(
                "the HIP runtime (libamdhip64.so) is not installed ({}); install ROCm or set ARBOR_HIP_LIB",
                errors.first().map(String::as_str).unwrap_or("not found")
            ))
        })
        .as_ref()
        .map_err(Clone::clone)
    }

    /// HIP's name of an error code.
    pub fn error_name(&self, e: HipError) -> String {
        // SAFETY: returns a static string for every code (or null).
        let p = unsafe { (self.get_error_name)(e) };
        if p.is_null() {
            return format!("hipError {e}");
        }
        // SAFETY: a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// `Ok` for `hipSuccess`, else an error naming the call and the code.
    pub fn check(&self, e: HipError, what: &str) -> arbor_engine_core::Result<()> {
        use arbor_engine_core::CoreError;
        match e {
            HIP_SUCCESS => Ok(()),
            HIP_ERROR_OUT_OF_MEMORY => Err(CoreError::OutOfMemory(format!(
                "{what}: {}",
                self.error_name(e)
            ))),
            _ => Err(CoreError::Device(format!("{what}: {}", self.error_name(e)))),
        }
    }

    /// The runtime's version as `major.minor.patch` (`HIP_VERSION` encoding).
    pub fn version(&self) -> Result<String, String> {
        let mut v: c_int = 0;
        // SAFETY: a valid out-pointer.
        let e = unsafe { (self.runtime_get_version)(&mut v) };
        if e != HIP_SUCCESS {
            return Err(format!("hipRuntimeGetVersion: {}", self.error_name(e)));
        }
        Ok(format!(
            "{}.{}.{}",
            v / 10_000_000,
            v / 100_000 % 100,
            v % 100_000
        ))
    }
}
