// spark-guard: what llama.cpp reserves for a model and settings, in bytes, without loading
// tensor data (no_alloc, as llama-fit-params does). Flags are llama-server's (common args).
// Prints: weights, context (KV + recurrent), compute for
//   fit:    n_outputs_max as llama-fit-params leaves it (0 = n_batch)
//   server: n_outputs_max = n_parallel, per seq 1 (tools/server: server_output_limits)
#include "llama.h"
#include "../src/llama-ext.h"
#include "arg.h"
#include "common.h"
#include "log.h"
#include <cstdio>

static void one(const common_params & params, const char * label, bool server) {
    auto mparams = common_model_params_to_llama(const_cast<common_params &>(params));
    auto cparams = common_context_params_to_llama(params);
    mparams.no_alloc  = true;
    mparams.load_mode = LLAMA_LOAD_MODE_NONE;
    if (server) {
        cparams.n_outputs_max = params.n_parallel;
        cparams.n_outputs_max_per_seq = 1;
    }
    llama_model * model = llama_model_load_from_file(params.model.path.c_str(), mparams);
    if (!model) { fprintf(stderr, "load failed\n"); exit(1); }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (!ctx) { fprintf(stderr, "context failed\n"); exit(1); }
    size_t m = 0, c = 0, k = 0;
    for (const auto & [buft, mb] : llama_get_memory_breakdown(ctx)) {
        m += mb.model; c += mb.context; k += mb.compute;
    }
    printf("SGMEM %s weights=%zu context=%zu compute=%zu n_ctx=%u\n", label, m, c, k, llama_n_ctx(ctx));
    fflush(stdout);
    llama_free(ctx);
    llama_model_free(model);
}

int main(int argc, char ** argv) {
    common_params params;
    common_init();
    if (!common_params_parse(argc, argv, params, LLAMA_EXAMPLE_SERVER)) return 1;
    if (params.n_parallel < 0) params.n_parallel = 1;  // llama-server's auto (-1) is 4 slots; say -np
    llama_backend_init();
    one(params, "fit", false);
    one(params, "server", true);
    llama_backend_free();
    return 0;
}
