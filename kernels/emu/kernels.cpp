// kernels.cpp: every kernel source of kernels/cuda, compiled for the host emulation.
#include "cuda_emu.h"
#include "registry.h"

#include "../cuda/encode.cu"
#include "../cuda/select.cu"
#include "../cuda/attention.cu"

void mkv_emu_register_kernels(std::vector<const mkv_emu::KernelEntry*>& v) {
    MKV_EMU_ENTRY(v, "mkv_encode", mkv_encode, 0);
    MKV_EMU_ENTRY(v, "mkv_decode", mkv_decode, 0);
    MKV_EMU_ENTRY(v, "mkv_block_meta", mkv_block_meta, 0);
    MKV_EMU_ENTRY(v, "mkv_rotate_queries", mkv_rotate_queries, 0);
    MKV_EMU_ENTRY(v, "mkv_score_blocks", mkv_score_blocks, 0);
    MKV_EMU_ENTRY(v, "mkv_select_topk", mkv_select_topk, 0);
    MKV_EMU_ENTRY(v, "mkv_plan_items", mkv_plan_items, 0);
    MKV_EMU_ENTRY(v, "mkv_page_meta", mkv_page_meta, 0);
    MKV_EMU_ENTRY(v, "mkv_page_score", mkv_page_score, 0);
    MKV_EMU_ENTRY(v, "mkv_packed_attention", mkv_packed_attention, MKV_ATT_THREADS);
    MKV_EMU_ENTRY(v, "mkv_dense_decode", mkv_dense_decode, MKV_DENSE_THREADS);
    MKV_EMU_ENTRY(v, "mkv_merge", mkv_merge, 0);
}
