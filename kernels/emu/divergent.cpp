// divergent.cpp: a negative case for the emulation's warp checks. attention.cu compiled
// with MKV_DENSE_DIVERGENT_LOOP, the loop shape mkv_dense_decode had before issue 17 (its
// trip count differs between the lane slots of one warp while mkv_group_sum shuffles
// with the full mask). Registered as "mkv_dense_decode_divergent"; the emulation must
// report it (kernels/tests/emu.rs). The other entry points get private names.
#include "cuda_emu.h"
#include "registry.h"

#define MKV_DENSE_DIVERGENT_LOOP 1
#define mkv_packed_attention mkv_packed_attention_divergent_tu
#define mkv_dense_decode mkv_dense_decode_divergent
#define mkv_merge mkv_merge_divergent_tu
#include "../cuda/attention.cu"

void mkv_emu_register_divergent(std::vector<const mkv_emu::KernelEntry*>& v) {
    MKV_EMU_ENTRY(v, "mkv_dense_decode_divergent", mkv_dense_decode_divergent, MKV_DENSE_THREADS);
}
