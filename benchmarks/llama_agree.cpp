// llama.cpp's next-token log-probabilities along a given token sequence, through its C API (libllama).
//
//   llama-agree MODEL.gguf THREADS K MODE PROMPT_IDS SEQ_IDS     (ids comma-separated)
//
// Decodes the prompt in one batch, then for each step i of SEQ prints one line: the argmax token id of the logits,
// then K "id:logprob" pairs (the top K of the log-softmax, computed in double from the float logits), and feeds
// SEQ[i] as a batch of one token (the decode path). llama-server's n_probs would do for a real vocabulary, but it
// drops the probabilities of a token whose text ends inside a UTF-8 character, which byte tokens often do.
// MODE f32: KV cache F32 and flash attention off, F32 throughout. MODE default: llama.cpp's defaults (KV cache F16,
// flash attention auto, which is on for the CPU; src/llama-graph.cpp casts F32 K/V to F16 for flash attention),
// what llama-bench and llama-server run unless told otherwise.
// Built by benchmarks/agree_llamacpp.py against a llama.cpp build.

#include "llama.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

static std::vector<llama_token> parse_ids(const char * s) {
    std::vector<llama_token> out;
    std::string cur;
    for (const char * p = s;; ++p) {
        if (*p == ',' || *p == '\0') {
            if (!cur.empty()) {
                out.push_back((llama_token) std::atoi(cur.c_str()));
            }
            cur.clear();
            if (*p == '\0') {
                break;
            }
        } else {
            cur += *p;
        }
    }
    return out;
}

int main(int argc, char ** argv) {
    if (argc != 7) {
        std::fprintf(stderr, "usage: %s MODEL.gguf THREADS K MODE PROMPT_IDS SEQ_IDS\n", argv[0]);
        return 2;
    }
    const int threads = std::atoi(argv[2]);
    const int k       = std::atoi(argv[3]);
    const std::string mode = argv[4];
    std::vector<llama_token> prompt = parse_ids(argv[5]);
    std::vector<llama_token> seq    = parse_ids(argv[6]);
    if (mode != "f32" && mode != "default") {
        std::fprintf(stderr, "MODE must be f32 or default, got %s\n", mode.c_str());
        return 2;
    }
    if (prompt.empty() || seq.empty() || threads < 1 || k < 1) {
        std::fprintf(stderr, "need a prompt, a sequence, THREADS >= 1 and K >= 1\n");
        return 2;
    }

    llama_log_set([](ggml_log_level level, const char * text, void *) {
        if (level >= GGML_LOG_LEVEL_ERROR) {
            std::fputs(text, stderr);
        }
    }, nullptr);
    llama_backend_init();

    llama_model_params mparams = llama_model_default_params();
    mparams.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx           = (uint32_t) (prompt.size() + seq.size() + 16);
    cparams.n_threads       = threads;
    cparams.n_threads_batch = threads;
    cparams.n_seq_max       = 1;
    if (mode == "f32") {
        cparams.type_k          = GGML_TYPE_F32;
        cparams.type_v          = GGML_TYPE_F32;
        cparams.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    }
    llama_context * ctx = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        std::fprintf(stderr, "cannot create a context\n");
        return 1;
    }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));

    if (llama_decode(ctx, llama_batch_get_one(prompt.data(), (int32_t) prompt.size())) != 0) {
        std::fprintf(stderr, "prompt decode failed\n");
        return 1;
    }
    std::vector<int> order(n_vocab);
    for (size_t i = 0; i < seq.size(); ++i) {
        const float * logits = llama_get_logits_ith(ctx, -1);
        double mx = logits[0];
        for (int v = 1; v < n_vocab; ++v) {
            mx = std::max(mx, (double) logits[v]);
        }
        double sum = 0.0;
        for (int v = 0; v < n_vocab; ++v) {
            sum += std::exp((double) logits[v] - mx);
        }
        const double lse = mx + std::log(sum);
        for (int v = 0; v < n_vocab; ++v) {
            order[v] = v;
        }
        const int top = std::min(k, n_vocab);
        std::partial_sort(order.begin(), order.begin() + top, order.end(),
                          [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
        std::printf("%d", order[0]);
        for (int j = 0; j < top; ++j) {
            std::printf(" %d:%.10g", order[j], (double) logits[order[j]] - lse);
        }
        std::printf("\n");
        if (i + 1 < seq.size()) {
            llama_token t = seq[i];
            if (llama_decode(ctx, llama_batch_get_one(&t, 1)) != 0) {
                std::fprintf(stderr, "decode failed at step %zu\n", i);
                return 1;
            }
        }
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
