// llama.cpp's logits for given token ids, for comparing swarm's engine with llama.cpp on any GGUF (a synthesized
// one included) without the llama-cpp-python package. Built by deploy/build-llama-cpp.sh against its static
// libraries, with the settings tests/fixtures/llama-refs used: F32 KV cache, no flash attention, no BOS added.
//
//   swarm-llama-logits MODEL.gguf OUT.bin N_GREEDY THREADS TOKEN...
//
// OUT.bin: int32 T, int32 V, int32 N_GREEDY; int32 greedy tokens [N_GREEDY]; float32 logits [T + N_GREEDY, V]:
// rows 0..T-1 the prompt's (one batch, every position), then one row per single-token decode call, each fed the
// argmax of the row before it (the first fed the argmax of the prompt's last row).
#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

static void quiet(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_ERROR) {
        fputs(text, stderr);
    }
}

static int argmax(const float * row, int n) {
    int best = 0;
    for (int i = 1; i < n; ++i) {
        if (row[i] > row[best]) {
            best = i;
        }
    }
    return best;
}

int main(int argc, char ** argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MODEL.gguf OUT.bin N_GREEDY THREADS TOKEN...\n", argv[0]);
        return 2;
    }
    const int n_greedy = atoi(argv[3]);
    const int threads = atoi(argv[4]);
    std::vector<llama_token> prompt;
    for (int i = 5; i < argc; ++i) {
        prompt.push_back(atoi(argv[i]));
    }
    const int T = (int) prompt.size();

    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_ubatch = 512;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.type_k = GGML_TYPE_F32;
    cp.type_v = GGML_TYPE_F32;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "cannot make a context\n");
        return 1;
    }
    const int V = llama_vocab_n_tokens(llama_model_get_vocab(model));

    llama_batch batch = llama_batch_init(T, 0, 1);
    for (int t = 0; t < T; ++t) {
        batch.token[t] = prompt[t];
        batch.pos[t] = t;
        batch.n_seq_id[t] = 1;
        batch.seq_id[t][0] = 0;
        batch.logits[t] = 1;
    }
    batch.n_tokens = T;
    if (llama_decode(ctx, batch) != 0) {
        fprintf(stderr, "decode of the prompt failed\n");
        return 1;
    }
    std::vector<float> rows((size_t) (T + n_greedy) * V);
    for (int t = 0; t < T; ++t) {
        const float * row = llama_get_logits_ith(ctx, t);
        std::copy(row, row + V, rows.begin() + (size_t) t * V);
    }
    llama_batch_free(batch);

    std::vector<int32_t> greedy;
    int next = argmax(&rows[(size_t) (T - 1) * V], V);
    for (int j = 0; j < n_greedy; ++j) {
        greedy.push_back(next);
        llama_token tok = next;
        if (llama_decode(ctx, llama_batch_get_one(&tok, 1)) != 0) {
            fprintf(stderr, "decode of greedy token %d failed\n", j);
            return 1;
        }
        const float * row = llama_get_logits_ith(ctx, -1);
        std::copy(row, row + V, rows.begin() + (size_t) (T + j) * V);
        next = argmax(row, V);
    }

    FILE * out = fopen(argv[2], "wb");
    if (!out) {
        fprintf(stderr, "cannot write %s\n", argv[2]);
        return 1;
    }
    const int32_t head[3] = {T, V, n_greedy};
    fwrite(head, sizeof(int32_t), 3, out);
    fwrite(greedy.data(), sizeof(int32_t), greedy.size(), out);
    fwrite(rows.data(), sizeof(float), rows.size(), out);
    fclose(out);

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
