// The fault drill's kernel, and its only use (ninfer_rt/cuda/fault_drill.py, `serve --debug-fault-after N`
// with NINFER_ALLOW_FAULT_DRILL=1): one thread writes `offset` floats past `base`, far outside every
// allocation, so the context dies with CUDA_ERROR_ILLEGAL_ADDRESS and the server's sticky-error path
// (rule 6: crash-context dump, 500s naming it, /health unhealthy, exit non-zero) runs on a real fault.
// Never launched otherwise. Launch: grid 1, block 1, no smem. The usual prologue (common.cuh) puts the
// write after the previous kernel on the stream, so the fault lands where the drill was armed.
#include "common.cuh"

extern "C" __global__ void fault_drill_write(float* base, long long offset) {
    enter_dependent_kernel();
    base[offset] = 1.0f;
}
