// llama.cpp's side of flowedge's A/B benchmark (tools/bench_vs_llamacpp.py): greedy decoding of exactly N new
// tokens per prompt through node-llama-cpp's prebuilt CPU binary, one JSON line per prompt on stdout.
//
//   node bench.mjs --model FILE.gguf --threads 1 --max-new-tokens 128 [--prompts FILE.jsonl] < prompts.jsonl
//
// A prompt line is {"id": ..., "tokens": [ids]} (ids as flowedge tokenized them, chat template included: both
// sides then decode from the same prompt tokens) or {"id": ..., "text": "..."} (already templated text;
// special tokens such as <|im_start|> are parsed). prefill_s is prompt evaluation up to the first new token;
// decode_s covers the other N-1 tokens, so decode_tokens_per_s = (N-1) / decode_s, as flowedge reports it.
// An end-of-generation token does not stop decoding (every prompt gets N tokens); eos_at says where it came.
import { readFileSync } from "node:fs";
import { performance } from "node:perf_hooks";
import { parseArgs } from "node:util";
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

const USAGE = "usage: node bench.mjs --model FILE.gguf [--threads N] [--max-new-tokens N] [--prompts FILE.jsonl]";

function options() {
    const { values } = parseArgs({
        options: {
            model: { type: "string" },
            threads: { type: "string", default: "1" },
            "max-new-tokens": { type: "string", default: "128" },
            prompts: { type: "string" },
            "batch-size": { type: "string", default: "512" },
        },
    });
    const threads = Number(values.threads), maxNew = Number(values["max-new-tokens"]);
    const batchSize = Number(values["batch-size"]);
    if (!values.model || !(threads >= 1) || !(maxNew >= 1) || !(batchSize >= 1))
        throw new Error(USAGE);
    return { model: values.model, threads, maxNew, batchSize, prompts: values.prompts ?? 0 };  // 0 = stdin
}

function readPrompts(source) {
    const lines = readFileSync(source, "utf8").split("\n").filter((line) => line.trim());
    if (!lines.length)
        throw new Error("no prompts given (JSON lines with 'id' and 'tokens' or 'text')");
    return lines.map((line, i) => {
        const p = JSON.parse(line);
        if (!Array.isArray(p.tokens) && typeof p.text !== "string")
            throw new Error(`prompt line ${i + 1}: needs 'tokens' (list of ids) or 'text'`);
        return { id: String(p.id ?? i + 1), tokens: p.tokens, text: p.text };
    });
}

// Greedy decoding of exactly maxNew tokens after the prompt; times the first token apart from the rest.
async function decode(sequence, promptTokens, maxNew) {
    await sequence.clearHistory();
    const generated = [];
    const t0 = performance.now();
    let firstMs = 0;
    const steps = sequence.evaluate(promptTokens, { temperature: 0, yieldEogToken: true });
    for await (const token of steps) {
        if (!generated.length)
            firstMs = performance.now();
        generated.push(token);
        if (generated.length >= maxNew)
            break;   // ends the generator: no evaluation of the last token
    }
    const endMs = performance.now();
    return { generated, prefillS: (firstMs - t0) / 1000, decodeS: (endMs - firstMs) / 1000 };
}

async function main() {
    const opts = options();
    const prompts = readPrompts(opts.prompts);
    // gpu: false and build: "never" pin the prebuilt CPU binary: never a GPU build, never a download or compile.
    const llama = await getLlama({ gpu: false, build: "never", skipDownload: true, maxThreads: opts.threads,
                                   logLevel: LlamaLogLevel.error, progressLogs: false });
    const tLoad = performance.now();
    const model = await llama.loadModel({ modelPath: opts.model, gpuLayers: 0 });
    const loadS = (performance.now() - tLoad) / 1000;
    const ids = prompts.map((p) => p.tokens ?? model.tokenize(p.text, true));
    const longest = Math.max(...ids.map((t) => t.length)) + opts.maxNew;
    const context = await model.createContext({ contextSize: Math.ceil(longest / 256) * 256, sequences: 1,
                                                batchSize: opts.batchSize,
                                                threads: { ideal: opts.threads, min: opts.threads } });
    const release = llama.llamaCppRelease;
    process.stderr.write(JSON.stringify({ engine: "llama.cpp", release: release.release, repo: release.repo,
                                          build: llama.buildType, gpu: llama.gpu, threads: context.currentThreads,
                                          context_size: context.contextSize, load_s: +loadS.toFixed(4),
                                          system_info: llama.systemInfo }) + "\n");
    const sequence = context.getSequence();
    for (const [i, p] of prompts.entries()) {
        const { generated, prefillS, decodeS } = await decode(sequence, ids[i], opts.maxNew);
        const eosAt = generated.findIndex((t) => model.isEogToken(t));
        process.stdout.write(JSON.stringify({
            id: p.id, engine: "llama.cpp", threads: opts.threads, prompt_tokens: ids[i].length,
            new_tokens: generated.length, prefill_s: +prefillS.toFixed(4), decode_s: +decodeS.toFixed(4),
            decode_tokens_per_s: generated.length > 1 && decodeS > 0 ? +((generated.length - 1) / decodeS).toFixed(3) : null,
            load_s: +loadS.toFixed(4), eos_at: eosAt >= 0 ? eosAt : null,
            token_ids: generated, text: model.detokenize(eosAt >= 0 ? generated.slice(0, eosAt) : generated),
        }) + "\n");
    }
    await llama.dispose();
}

main().catch((err) => {
    process.stderr.write(`bench.mjs: ${err.message ?? err}\n`);
    process.exit(1);
});
