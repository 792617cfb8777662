// The test binaries link libtorch through the tracer; they need the same
// rpath and libtorch_cuda link as the tracer's own binaries.
include!("../tracer/build.rs");
