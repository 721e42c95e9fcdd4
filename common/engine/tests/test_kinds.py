"""The cache codec on the real mlx-lm (MLX only, no vLLM, no daemons): for each cache kind, dtype
and model family the decoder runs, the cache path rebuilt from the decoder's bundle reproduces the
decoder's own cache bit for bit from the decoder's own layer inputs, and a cache restored from
reconstructed rows generates exactly what the decoder generates natively."""

from __future__ import annotations

import re
import tempfile
import unittest
from pathlib import Path

import mlx.core as mx
import mlx.utils
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

from pdbridge_cache import kinds
from pdbridge_cache.check import native_prefill, same_input
from pdbridge_cache.layers import CachePath, effective_rope
from pdbridge_mlx.engine import Engine
from pdbridge_testkit.decoder import export_blocks

REPO = Path(__file__).resolve().parents[3]

MODELS = REPO / "models"
MODEL = MODELS / "tiny-llama3-mlx"
BLOCK = 64
STEP = 96  # native prefill chunks that do not line up with blocks


def prompt(n: int) -> list[int]:
    from tokenizers import Tokenizer

    text = (REPO / "LICENSE").read_text()
    return Tokenizer.from_file(str(MODEL / "tokenizer.json")).encode(text).ids[:n]


class CacheKindsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="pdb-kinds-")
        cls.tokens = prompt(5 * BLOCK + 17)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def engine(self, dtype, kv_bits=None, kv_group_size=64, model: Path = MODEL) -> Engine:
        return Engine(str(model), block_tokens=BLOCK, dtype=dtype, bundle_dir=self.tmp.name,
                      kv_bits=kv_bits, kv_group_size=kv_group_size)

    def test_reconstruction_from_the_bundle_is_the_decoders_cache(self):
        cases = [(mx.float32, None, 64, "KVCache"), (mx.bfloat16, None, 64, "KVCache"),
                 (mx.float32, 4, 32, "QuantizedKVCache"), (mx.bfloat16, 8, 64, "QuantizedKVCache")]
        for dtype, bits, group, cls_name in cases:
            with self.subTest(dtype=str(dtype), kv_bits=bits):
                engine = self.engine(dtype, bits, group)
                layer = engine.spec["layers"][0]
                self.assertEqual((layer["cache_class"], layer["kind"], layer["kv_bits"]), (cls_name, kinds.ROWS, bits or 0))
                path = CachePath.from_bundle(str(engine.bundle_path))
                result = same_input(engine.model, path, self.tokens, BLOCK, STEP, engine.kv_args)
                per_block = len(layer["tensors"]) * engine.num_layers
                self.assertEqual(result.tensors_total, 6 * per_block)  # 5 blocks and the 17-token rest
                self.assertEqual(result.tensors_exact, result.tensors_total, result)

    def test_a_restored_cache_generates_what_the_decoder_generates(self):
        for dtype, bits in [(mx.float32, None), (mx.bfloat16, 4)]:
            with self.subTest(dtype=str(dtype), kv_bits=bits):
                engine = self.engine(dtype, bits, 32)
                native, _, _ = native_prefill(engine.model, self.tokens, STEP, engine.kv_args)
                n = 3 * BLOCK
                rows = [{k: [a] for k, a in kinds.codec_for(c).tensors(c).items()} for c in native]
                restored = kinds.restore(engine.templates, rows, n, dtype)

                def greedy(cache, tokens):
                    steps = generate_step(mx.array(tokens), engine.model, prompt_cache=cache, max_tokens=12,
                                          prefill_step_size=STEP, **engine.kv_args)
                    return [int(t) for t, _ in steps]

                # Native: the model's plain caches, quantized by generate_step as it goes.
                self.assertEqual(greedy(restored, self.tokens[n:]), greedy(make_prompt_cache(engine.model), self.tokens))

    def test_other_families_sliding_windows_and_latent_caches(self):
        """Gemma 3 (RotatingKVCache sliding layers, q/k norms), DeepSeek-V3 (MLA: a latent and a
        rope key of other widths), gpt-oss (sliding layers, k/v biases, sinks that are not cached)
        and Qwen3 (per-head k norms, 8-bit weights): exact reconstruction, only the cache path's
        parameters in the bundle, and a cache restored at a block boundary from reconstructed rows
        generates as the decoder does."""
        cases = {
            "gemma3": ({"RotatingKVCache", "KVCache"}, {"input_layernorm", "k_proj", "v_proj", "k_norm"}),
            "deepseek_v3": ({"KVCache"}, {"input_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"}),
            "gpt_oss": ({"RotatingKVCache", "KVCache"}, {"input_layernorm", "k_proj", "v_proj"}),
            "qwen3": ({"KVCache"}, {"input_layernorm", "k_proj", "v_proj", "k_norm"}),
        }
        for family, (classes, params) in cases.items():
            with self.subTest(family=family):
                engine = self.engine(mx.float32, model=MODELS / f"tiny-{family}-mlx")
                self.assertEqual({l["cache_class"] for l in engine.spec["layers"]}, classes)
                shipped = {name.split(".")[-2] for name in mx.load(str(engine.bundle_path))}
                self.assertEqual(shipped, params)
                path = CachePath.from_bundle(str(engine.bundle_path))
                result = same_input(engine.model, path, self.tokens, BLOCK, STEP, engine.kv_args)
                self.assertGreater(result.tensors_total, 0)
                self.assertEqual(result.tensors_exact, result.tensors_total, result)

                n = 3 * BLOCK
                _, hidden, _ = native_prefill(engine.model, self.tokens[:n], STEP, engine.kv_args)
                rows: list[dict[str, list]] = [{} for _ in hidden]
                for b in range(n // BLOCK):
                    block = mx.stack([h[b * BLOCK:(b + 1) * BLOCK] for h in hidden], axis=1)
                    for layer, name, array in path.block(block, b * BLOCK):
                        rows[layer].setdefault(name, []).append(array)
                restored = kinds.restore(engine.templates, rows, n, mx.float32)

                def greedy(cache, tokens):
                    steps = generate_step(mx.array(tokens), engine.model, prompt_cache=cache, max_tokens=12,
                                          prefill_step_size=STEP)
                    return [int(t) for t, _ in steps]

                self.assertEqual(greedy(restored, self.tokens[n:]), greedy(make_prompt_cache(engine.model), self.tokens))

    def test_the_spec_names_the_rope_the_module_applies_not_the_config(self):
        """mlx-lm's llama reads `rope_scaling` and ignores transformers 5's `rope_parameters`: the
        spec must then say `default`, so prefilld (whose vLLM applies the scaling) refuses."""
        from mlx_lm.models import llama

        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 1024}
        base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 128,
                "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 32,
                "rope_theta": 5e5, "max_position_embeddings": 8192}
        for config, kind in [({"rope_scaling": scaling}, "llama3"),
                             ({"rope_parameters": {**scaling, "rope_theta": 5e5}}, "default")]:
            args = llama.ModelArgs.from_dict({**base, **config})
            model = llama.Model(args)
            rope = effective_rope(model.layers[0].self_attn, args.rope_theta, args.rope_scaling)
            self.assertEqual((rope["kind"], rope["base"]), (kind, 5e5), config)

    def test_a_recurrent_state_is_the_decoders_at_every_block_end_and_at_the_tail(self):
        """Qwen3-Next: gated delta-net layers (ArraysCache: a conv state and an fp32 state matrix)
        beside a full-attention layer. Reconstructed block by block with the state carried, each
        block's state equals the state of a native prefill ending there — five block ends and the
        prompt's tail, which ends at prompt[:-1] — and the attention rows the native rows. The
        bundle ships only what the states and rows depend on. Restored from those blocks and the
        tail, the cache answers as the decoder does."""
        engine = self.engine(mx.float32, model=MODELS / "tiny-qwen3_next-mlx")
        layers = [(l["cache_class"], l["kind"]) for l in engine.spec["layers"]]
        self.assertEqual(layers, [("ArraysCache", kinds.SNAPSHOT)] * 3 + [("KVCache", kinds.ROWS)])
        self.assertEqual([t["shape"] for t in engine.spec["layers"][0]["tensors"]], [[1, 3, 1024], [1, 4, 128, 128]])
        shipped = {re.sub(r"^.*layers\.\d+\.", "", name).rsplit(".", 1)[0] for name in mx.load(str(engine.bundle_path))}
        self.assertEqual(shipped, {"input_layernorm", "linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba",
                                   "linear_attn.conv1d", "linear_attn", "self_attn.k_proj", "self_attn.v_proj",
                                   "self_attn.k_norm"})
        path = CachePath.from_bundle(str(engine.bundle_path))
        prompt = self.tokens[:-1]  # what a bridge covers: 5 whole blocks and a 16-token tail
        result = same_input(engine.model, path, prompt, BLOCK, STEP, engine.kv_args)
        self.assertEqual(result.tensors_total, 6 * (3 * 2 + 2))
        self.assertEqual(result.tensors_exact, result.tensors_total, result)

        _, hidden, _ = native_prefill(engine.model, prompt, STEP, engine.kv_args)
        parts: list[dict[str, list]] = [{} for _ in hidden]
        states = path.new_states()
        for lo in range(0, len(prompt), BLOCK):
            block = mx.stack([h[lo:lo + BLOCK] for h in hidden], axis=1)
            for layer, name, array in path.block(block, lo, states=states):
                parts[layer].setdefault(name, []).append(array)
        restored = kinds.restore(engine.templates, parts, len(prompt), mx.float32)

        def greedy(cache, tokens):
            steps = generate_step(mx.array(tokens), engine.model, prompt_cache=cache, max_tokens=12,
                                  prefill_step_size=STEP)
            return [int(t) for t, _ in steps]

        self.assertEqual(greedy(restored, self.tokens[-1:]), greedy(make_prompt_cache(engine.model), self.tokens))

    def test_deepseek_v41_windows_and_pools_are_the_decoders_at_every_block_end(self):
        """DeepSeek-V4.1 (LayerCache: an fp8-rounded sliding window; pooled fp4-rounded compressed
        rows and index keys in layers 1 and 3). Per block: the window and the groups the block
        closed, packed in MLX's mxfp8/nvfp4/mxfp4 (a quarter of the fp32 bytes, lossless).
        Reconstructed from the decoder's own layer inputs, every tensor of every block is the
        decoder's own, the bundle ships only the KV path (not the queries, the indexer's query path
        or the outputs), and the decoder's exported blocks restore at a block boundary to a cache
        that answers as the decoder does. Blocks the pools or the window do not fit are refused."""
        engine = self.engine(mx.float32, model=MODELS / "tiny-deepseek_v41-mlx")
        layers = engine.spec["layers"]
        self.assertEqual({(l["cache_class"], l["kind"], l["window"]) for l in layers},
                         {("LayerCache", kinds.POOLED, 32)})
        shapes = {t["name"]: (t["dtype"], t["shape"]) for t in layers[1]["tensors"]}
        groups = BLOCK // 4
        u32, u8 = "DTYPE_U32", "DTYPE_U8"
        self.assertEqual(shapes, {"window": (u32, [1, 32, 16]), "window_scales": (u8, [1, 32, 2]),
                                  "compress_kv": (u32, [1, groups, 8]), "compress_kv_scales": (u8, [1, groups, 4]),
                                  "index_k": (u32, [1, groups, 4]), "index_k_scales": (u8, [1, groups, 1])})
        self.assertEqual([t["name"] for t in layers[2]["tensors"]], ["window", "window_scales"])
        self.assertEqual([t["shape"][1] for t in layers[3]["tensors"]][2:], [BLOCK // 16] * 4)
        shipped = {re.sub(r"^.*layers\.\d+\.", "", name).rsplit(".", 1)[0] for name in mx.load(str(engine.bundle_path))}
        self.assertEqual(shipped, {"input_layernorm", "self_attn.kv_proj", "self_attn.kv_norm",
                                   "self_attn.compressor.kv_proj", "self_attn.compressor.gate_proj",
                                   "self_attn.compressor.kv_norm", "self_attn.indexer.k_proj",
                                   "self_attn.indexer.k_norm"})
        prompt = self.tokens[:5 * BLOCK]
        path = CachePath.from_bundle(str(engine.bundle_path))
        result = same_input(engine.model, path, prompt, BLOCK, STEP, engine.kv_args)
        self.assertEqual(result.tensors_total, 5 * sum(len(l["tensors"]) for l in layers))
        self.assertEqual(result.tensors_exact, result.tensors_total, result)

        exported = export_blocks(engine, prompt, Path(self.tmp.name, "v41-blocks"))
        self.assertEqual(len(exported), 5)
        cache, cached = engine.restore(exported[:3], None, self.tokens, None)
        self.assertEqual((cached, [c.offset for c in cache]), (3 * BLOCK, [3 * BLOCK] * 4))

        def greedy(cache, tokens):
            steps = generate_step(mx.array(tokens), engine.model, prompt_cache=cache, max_tokens=12,
                                  prefill_step_size=STEP)
            return [int(t) for t, _ in steps]

        self.assertEqual(greedy(cache, self.tokens[cached:]), greedy(make_prompt_cache(engine.model), self.tokens))
        with self.assertRaisesRegex(Exception, "cannot be rewound"):  # blocks ending with the last token
            engine.restore(exported, None, prompt, None)
        with self.assertRaisesRegex(ValueError, "mxfp8 cannot hold"):  # values mlx-lm never rounded
            kinds.codec_for(cache[0]).pack({"window": mx.random.normal((1, 32, 64), key=mx.random.key(0))})
        for block_tokens, reason in [(40, "leaves 8 in an open compression group"),
                                     (16, "shorter than the sliding window of 32")]:
            with self.subTest(block_tokens=block_tokens):
                other = Engine(str(MODELS / "tiny-deepseek_v41-mlx"), block_tokens=block_tokens, dtype=mx.float32,
                               bundle_dir=self.tmp.name)
                self.assertIn(reason, other.spec["layers"][3]["unsupported_reason"])

    def test_llama4_chunked_attention_rows_are_the_decoders_and_restore_at_any_token(self):
        """Llama 4 (ChunkedKVCache on three layers of four: RoPE'd, q/k-normed keys, of which the
        decoder keeps the last `attention_chunk_size` rows; a NoPE KVCache on every fourth): a codec
        of per-token rows, so its spec is the rows' (rewindable, tails, from layer inputs) and no
        reader needs to know it. Reconstructed from the decoder's own layer inputs through a bundle,
        every row the decoder still holds is its own, bit for bit (a chunk of 80 tokens straddles
        the 64-token blocks and the 96-token prefill steps), and a cache restored from the
        reconstructed blocks and a tail answers as the decoder does."""
        from mlx_lm.models import llama4
        from mlx_lm.models.cache import ChunkedKVCache

        from pdbridge_cache.safetensors_io import serialize

        text = {"model_type": "llama4_text", "attention_bias": False, "attention_chunk_size": 80, "head_dim": 16,
                "hidden_size": 64, "interleave_moe_layer_step": 2, "intermediate_size": 64,
                "intermediate_size_mlp": 128, "max_position_embeddings": 4096, "num_attention_heads": 4,
                "num_experts_per_tok": 1, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 2,
                "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 5e5, "use_qk_norm": True,
                "vocab_size": 49152}
        config = {"model_type": "llama4", "text_config": text}
        mx.random.seed(4)
        model = llama4.Model(llama4.ModelArgs.from_dict(config))
        model.update(mlx.utils.tree_map(lambda a: a * 4, model.parameters()))  # wider than the init, as trained
        mx.eval(model.parameters())

        caches = make_prompt_cache(model)
        model(mx.zeros((1, BLOCK), mx.int32), cache=caches)
        layers = [kinds.describe(i, c) for i, c in enumerate(caches)]
        self.assertEqual([l["cache_class"] for l in layers], ["ChunkedKVCache"] * 3 + ["KVCache"])
        for layer in layers:
            self.assertEqual((layer["kind"], layer["rewindable"], layer["takes_tail"], layer["from_inputs"]),
                             (kinds.ROWS, True, True, True))
            self.assertEqual([(t["name"], t["shape"], t["token_axis"], t["extent"]) for t in layer["tensors"]],
                             [(n, [1, 2, 1, 16], 2, kinds.PER_TOKEN) for n in ("keys", "values")])

        templates = make_prompt_cache(model)
        decoder = CachePath(model, templates, mx.float32)
        params = decoder.needed_params(probe_tokens=BLOCK)
        shipped = {re.sub(r"^.*layers\.\d+\.", "", name).rsplit(".", 1)[0] for name, _ in params}
        self.assertEqual(shipped, {"input_layernorm", "self_attn.k_proj", "self_attn.v_proj"})
        bundle = Path(self.tmp.name, "llama4-bundle.safetensors")
        bundle.write_bytes(serialize(params, decoder.bundle_metadata(config, 0, 64)))
        path = CachePath.from_bundle(str(bundle))
        self.assertEqual({type(c) for c in path.templates}, {ChunkedKVCache, KVCache})
        self.assertFalse(path.per_block or path.recurrent)
        result = same_input(model, path, self.tokens, BLOCK, STEP, {})
        self.assertGreater(result.tensors_total, 6 * 2)  # more than the full-attention layer's rows
        self.assertEqual(result.tensors_exact, result.tensors_total, result)

        # Restored from reconstructed blocks and a tail at 3 blocks and 17 tokens (past two chunks).
        n = 3 * BLOCK + 17
        _, hidden, _ = native_prefill(model, self.tokens[:n], STEP, {})
        parts: list[dict[str, list]] = [{} for _ in hidden]
        for lo in range(0, n, BLOCK):
            block = mx.stack([h[lo:lo + BLOCK] for h in hidden], axis=1)
            for layer, name, array in path.block(block, lo):
                parts[layer].setdefault(name, []).append(array)
        restored = kinds.restore(templates, parts, n, mx.float32)
        self.assertEqual([(c.offset, c.keys.shape[2]) for c in restored[:3]], [(n, 80)] * 3)

        def greedy(cache, tokens):
            steps = generate_step(mx.array(tokens), model, prompt_cache=cache, max_tokens=12, prefill_step_size=STEP)
            return [int(t) for t, _ in steps]

        self.assertEqual(greedy(restored, self.tokens[n:]), greedy(make_prompt_cache(model), self.tokens))

    def test_every_codec_declares_its_kind_extent_and_traits(self):
        """What the spec publishes comes from each codec's declaration, and the rules readers apply
        to it are written once (`format.tensor_shape`, the Python side of `spec::rows_tensor`)."""
        from pdbridge_cache.format import tensor_shape

        for cls, codec in kinds._CODECS.items():
            with self.subTest(cache=cls.__name__):
                self.assertIn(codec.kind, (kinds.ROWS, kinds.SNAPSHOT, kinds.POOLED))
                self.assertIn(codec.extent, (kinds.PER_TOKEN, kinds.FIXED, kinds.PER_BLOCK))
                self.assertFalse(codec.extent == kinds.PER_BLOCK and codec.takes_tail, "a whole block's has no tail")
        rows = {"shape": ["1", "3", "1", "64"], "token_axis": 2, "extent": kinds.PER_TOKEN}
        state = {"shape": [1, 3, 32], "token_axis": 0, "extent": kinds.FIXED}
        pools = {"shape": [1, 4, 8], "token_axis": 1, "extent": kinds.PER_BLOCK}
        self.assertEqual([tensor_shape(t, 5, 16) for t in (rows, state, pools)], [(1, 3, 5, 64), (1, 3, 32), None])
        self.assertEqual([tensor_shape(t, 16, 16) for t in (rows, state, pools)],
                         [(1, 3, 16, 64), (1, 3, 32), (1, 4, 8)])
        self.assertIsNone(tensor_shape({"shape": [1], "token_axis": 0}, 16, 16), "no extent, no shape")

    def test_a_cache_without_a_codec_is_described_as_unsupported(self):
        cache = CacheList(KVCache(), KVCache())
        layer = kinds.describe(3, cache)
        self.assertEqual((layer["kind"], layer["index"], layer["tensors"]), (kinds.UNSUPPORTED, 3, []))
        self.assertIn("sub-caches", layer["unsupported_reason"])
        self.assertEqual([layer[t] for t in ("rewindable", "takes_tail", "from_inputs")], [False] * 3)
        with self.assertRaises(kinds.UnsupportedCache):
            kinds.codec_for(cache)


if __name__ == "__main__":
    unittest.main(verbosity=2)
