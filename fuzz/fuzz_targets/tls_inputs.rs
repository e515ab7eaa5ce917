#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| shoal_fuzz::tls_inputs(data));
