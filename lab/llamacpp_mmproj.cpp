// spark-guard: what llama.cpp's multimodal library (tools/mtmd, clip.cpp) reserves for a
// projector (--mmproj), in bytes, without loading tensor data: mtmd_get_memory_usage, the
// call llama-server makes to size the projector (no_alloc), once without the warmup (the
// weights alone) and once with it (weights + the compute buffer clip reserves at load, the
// graph of its warmup image). Flash attention as llama-server passes it (-fa): auto, on, off.
// Usage: sg-mmproj MMPROJ.gguf
// Prints: SGMMPROJ fa=<auto|on|off> weights=<bytes> compute=<bytes>
#include "mtmd.h"
#include "ggml-backend.h"
#include <cstdio>

static size_t total(const char * path, mtmd_context_params p) {
    size_t n = 0;
    for (const auto & [dev, size] : mtmd_get_memory_usage(path, p)) n += size;
    return n;
}

int main(int argc, char ** argv) {
    if (argc != 2) { fprintf(stderr, "usage: %s MMPROJ.gguf\n", argv[0]); return 1; }
    ggml_backend_load_all();
    const struct { const char * name; llama_flash_attn_type type; } fas[] = {
        {"auto", LLAMA_FLASH_ATTN_TYPE_AUTO},
        {"on", LLAMA_FLASH_ATTN_TYPE_ENABLED},
        {"off", LLAMA_FLASH_ATTN_TYPE_DISABLED},
    };
    for (const auto & fa : fas) {
        mtmd_context_params p = mtmd_context_params_default();
        p.flash_attn_type = fa.type;
        p.n_threads = 1;
        p.warmup = false;
        const size_t weights = total(argv[1], p);
        p.warmup = true;
        const size_t all = total(argv[1], p);
        if (weights == 0 || all < weights) { fprintf(stderr, "%s: failed\n", argv[1]); return 1; }
        printf("SGMMPROJ fa=%s weights=%zu compute=%zu\n", fa.name, weights, all - weights);
        fflush(stdout);
    }
    return 0;
}
