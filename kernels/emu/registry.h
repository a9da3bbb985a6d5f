// registry.h: type-erased entry points of the emulated kernels (see emu.cpp).
#pragma once
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

namespace mkv_emu {

constexpr size_t kMaxArgs = 32;

// One kernel: its name, its parameters' sizes (checked against what the host pushes),
// its __launch_bounds__ (0: none) and a call that unpacks a cuLaunchKernel-style
// argument array (one pointer per parameter, to the parameter's value).
struct KernelEntry {
    const char* name;
    size_t nargs;
    size_t sizes[kMaxArgs];
    unsigned launch_bound;
    void (*invoke)(void** args);
};

template <class... A>
struct Sig {
    template <void (*K)(A...), size_t... I>
    static void call(void** a, std::index_sequence<I...>) {
        K(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(a[I])...);
    }
    template <void (*K)(A...)>
    static void invoke(void** a) {
        call<K>(a, std::index_sequence_for<A...>{});
    }
    template <void (*K)(A...)>
    static KernelEntry entry(const char* name, unsigned bound) {
        static_assert(sizeof...(A) <= kMaxArgs);
        KernelEntry e{name, sizeof...(A), {sizeof(A)...}, bound, &invoke<K>};
        return e;
    }
};

template <class... A>
Sig<A...> sig_of(void (*)(A...));

}  // namespace mkv_emu

// Registers kernel `k` (an extern "C" function) under `name` with launch bound `bound`.
#define MKV_EMU_ENTRY(v, name, k, bound)                                                    \
    do {                                                                                    \
        using S = decltype(::mkv_emu::sig_of(&k));                                          \
        static const ::mkv_emu::KernelEntry e = S::template entry<&k>(name, bound);          \
        (v).push_back(&e);                                                                  \
    } while (0)

void mkv_emu_register_kernels(std::vector<const mkv_emu::KernelEntry*>& v);
void mkv_emu_register_divergent(std::vector<const mkv_emu::KernelEntry*>& v);
void mkv_emu_register_selftest(std::vector<const mkv_emu::KernelEntry*>& v);
