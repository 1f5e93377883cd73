//! The options of the benchmark commands.

use std::path::PathBuf;

use clap::Args;

#[derive(Debug, Args)]
pub struct BenchCellplmArgs {
    /// Model genes (the released gene_list's 19,374 by default).
    #[arg(long, default_value_t = 19374)]
    pub genes: usize,
    /// Encoder width (enc_hid).
    #[arg(long, default_value_t = 1024)]
    pub hidden: usize,
    /// Flowformer layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Latent (embedding) size.
    #[arg(long, default_value_t = 512)]
    pub latent: usize,
    /// Expressed genes per synthetic cell.
    #[arg(long, default_value_t = 1000)]
    pub nnz: usize,
    /// Cells to embed per pass.
    #[arg(long, default_value_t = 100000)]
    pub cells: usize,
    /// Cells per forward pass (attending to each other; the method's default 50,000).
    #[arg(long, default_value_t = 50000)]
    pub batch: usize,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32 (upstream's, and embed's) or bf16 (the products in bfloat16: methods/cellplm.rs).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16"])]
    pub dtype: String,
    /// Timed passes (the best is reported), after one warm-up forward pass.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct BenchScimilarityArgs {
    /// Input genes (the released model_v1.1 gene order's length by default).
    #[arg(long, default_value_t = 28231)]
    pub genes: usize,
    /// Hidden layer sizes, comma-separated.
    #[arg(long, default_value = "1024,1024")]
    pub hidden: String,
    /// Latent (embedding) size.
    #[arg(long, default_value_t = 128)]
    pub latent: usize,
    /// Cells to embed per pass.
    #[arg(long, default_value_t = 20480)]
    pub cells: usize,
    /// Cells per batch (the method's default, 2048).
    #[arg(long, default_value_t = 2048)]
    pub batch: usize,
    /// cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Timed passes (the best is reported), after one warm-up pass.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

#[derive(Debug, Args)]
pub struct BenchEncoderArgs {
    /// `bert` (candle's BERT encoder; --layers, --hidden, --heads, --ffn, --max-len needed),
    /// `c2s-160m` / `c2s-410m` (our GPT-NeoX at Pythia's full size; those four may override),
    /// or `sccello` / `langcell` (the model's own <cls> encoder at its released shape, as
    /// `embed` runs it; --max-len defaults to its 2,048 positions), `scfoundation` (its
    /// encoder at the released 12 x 768 shape; --layers, --hidden, --heads may override), `novae` (Novae's graph
    /// encoder at full size on a synthetic slide of --cells cells; --max-len = genes, default
    /// 500; --lengths is not read; f32 only).
    /// `scbert`: scBERT's Performer at its released shape (16,907 positions; float32 only).
    /// `scprint`: scPRINT's transformer at medium-v1.5's shape (256 x 8, 4 heads; --layers,
    /// --hidden, --heads may override); every cell has --max-len genes (default 4,000).
    /// `cellfm`: CellFM's retention encoder at the released 800M shape (40 x 1536, 48 heads;
    /// --layers, --hidden, --heads may override; genes per cell capped at 2,048).
    /// `gemm`: no encoder; square matrix products at n = 4,096, 8,192 and 16,384 (--hidden for
    /// one size), the card's ceiling the encoders' useful TFLOP/s are held against.
    /// `scgpt`: scGPT's own model as `embed` runs it (float32 input encoders, packed layers in
    /// --dtype) at the whole-human shape (--layers, --hidden, --heads, --ffn may override).
    #[arg(long, default_value = "bert")]
    pub arch: String,
    /// novae: write the synthetic slide's graph (CSR indptr, indices, dist) as JSON here, for
    /// bench/novae_torch.py.
    #[arg(long, value_name = "FILE")]
    pub graph_out: Option<PathBuf>,
    /// Encoder layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Model width (d_model).
    #[arg(long)]
    pub hidden: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    /// Feed-forward width.
    #[arg(long)]
    pub ffn: Option<usize>,
    /// Longest sequence (longer cells are cut, as the tokenizers do).
    #[arg(long)]
    pub max_len: Option<usize>,
    /// Token lengths, one integer per line (cells are drawn from it in order, cycling).
    #[arg(long, value_name = "FILE")]
    pub lengths: PathBuf,
    /// Cells to run.
    #[arg(long, default_value_t = 2048)]
    pub cells: usize,
    /// Cells per batch.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// `tokens` batches by tokens, as `embed` does (`--batch` cells of the longest length make
    /// the budget; shorter cells fill it, up to `--batch-growth` x `--batch` cells, see
    /// gpu/backoff.rs TokenBudget); `cells`: `--batch` cells a batch (before). Every arch but
    /// scprint (whose cells all have the same length) and gemm.
    #[arg(long, default_value = "tokens", value_parser = ["cells", "tokens"])]
    pub batching: String,
    /// With `--batching tokens`: most cells a batch, as a multiple of `--batch` (`embed` uses
    /// gpu/backoff.rs BATCH_GROWTH, 8).
    #[arg(long, default_value_t = scfoundry::gpu::backoff::BATCH_GROWTH)]
    pub batch_growth: usize,
    /// bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// cpu or cuda.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// `sorted`: cells by length, so a batch pads little; `file`: as they come.
    #[arg(long, default_value = "sorted")]
    pub order: String,
    /// Timed passes over the cells (after one untimed warm-up batch); the best is reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
    /// --arch bert: run candle-transformers' BertModel over padded batches with a padding mask
    /// (the path before packing) instead of packed cells with variable-length attention.
    #[arg(long)]
    pub padded: bool,
    /// --arch bert: before timing, check the packed encoder against the padded BertModel on the
    /// first batch and the fused attention kernel against the plain-candle reference; the
    /// largest differences go into the JSON line (and, on a GPU in bf16, the fused encoder
    /// against the same layers in candle ops).
    #[arg(long)]
    pub check: bool,
    /// Run candle's separate ops instead of the fused GPU path, for comparison: --arch bert's
    /// packed encoder (`gpu/fused_encoder.rs`); scbert's FAVOR+ features (`gpu/favor.rs`), novae's
    /// GATv2 attention (`gpu/gat_attention.rs`) and cellfm's retention steps (`gpu/retention.rs`),
    /// whose fused path (their default on a GPU, as in `embed`) is otherwise checked against
    /// candle's ops on the first batch (`fused_vs_candle_ops`).
    #[arg(long)]
    pub unfused: bool,
    /// --arch bert, GPU bf16: also time each step of one layer on the first batch (median of 20)
    /// and print the shares of a layer in the JSON line.
    #[arg(long)]
    pub profile: bool,
    /// --arch bert: the feed-forward activation, `gelu` (BERT's, erf form) or `relu` (what
    /// Geneformer's config.json, scGPT and UCE use).
    #[arg(long, default_value = "gelu", value_parser = ["gelu", "relu"])]
    pub activation: String,
    /// --arch bert: read each batch's embeddings back before queueing the next (what every
    /// batch loop did before `gpu/readback.rs`) instead of one batch behind, for comparison.
    #[arg(long)]
    pub sync_batches: bool,
    /// The random models' layer-norm weights: `ones` (weight 1, bias 0, as PyTorch initialises
    /// them and about where trained checkpoints keep them, so activations have a real model's
    /// scale) or `random` (drawn N(0, 0.02) like every other weight, as the tables before
    /// 2026-12-02 were measured).
    #[arg(long, default_value = "ones", value_parser = ["ones", "random"])]
    pub norm_weights: String,
}

#[derive(Debug, Args)]
pub struct BenchScviArgs {
    /// Model genes (encoder inputs).
    #[arg(long, default_value_t = 2000)]
    pub genes: usize,
    /// n_hidden.
    #[arg(long, default_value_t = 128)]
    pub hidden: usize,
    /// n_latent.
    #[arg(long, default_value_t = 10)]
    pub latent: usize,
    /// n_layers.
    #[arg(long, default_value_t = 1)]
    pub layers: usize,
    /// Cells to run.
    #[arg(long, default_value_t = 100_000)]
    pub cells: usize,
    /// Cells per batch.
    #[arg(long, default_value_t = 128)]
    pub batch: usize,
    /// Distinct synthetic batches made before timing, cycled.
    #[arg(long, default_value_t = 8)]
    pub pool: usize,
    /// cpu or cuda.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Timed passes (after one untimed batch); the best is reported.
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
}

#[derive(Debug, clap::Args)]
pub struct BenchPairwiseArgs {
    /// Cells (synthetic: `--labels` Gaussian clusters, every 97th cell a copy of the one before,
    /// so that ties occur).
    #[arg(long, default_value_t = 50_000)]
    pub cells: usize,
    /// Dimensions.
    #[arg(long, default_value_t = 50)]
    pub dims: usize,
    /// Neighbours (self included).
    #[arg(long, default_value_t = 90)]
    pub k: usize,
    /// Labels (clusters) for the silhouette's per-label sums.
    #[arg(long, default_value_t = 10)]
    pub labels: usize,
    /// Seed of the synthetic cells.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Skip the CPU side (timing the GPU alone at sizes where the CPU takes minutes).
    #[arg(long)]
    pub gpu_only: bool,
}

#[derive(Debug, Args)]
pub struct BenchTrainAttentionArgs {
    /// Cells of the accuracy check (each path against f32 on the same bf16 inputs).
    #[arg(long, default_value_t = 4)]
    pub check_cells: usize,
    /// Token lengths of the accuracy check (one run each; a length not a multiple of 64 checks
    /// the tiles' tails).
    #[arg(long, value_delimiter = ',', default_value = "1201,77")]
    pub check_lengths: Vec<usize>,
    /// Cells of the timed passes (scgpt_integrated's minibatch).
    #[arg(long, default_value_t = 64)]
    pub cells: usize,
    /// Tokens a cell of the timed passes (scgpt_integrated's 1,200 genes and the cell token).
    #[arg(long, default_value_t = 1201)]
    pub len: usize,
    /// Heads (of 64).
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    /// Dropout on the probabilities (0: none).
    #[arg(long, default_value_t = 0.1)]
    pub dropout: f64,
    /// Timed forward and backward passes of each path (after one untimed).
    #[arg(long, default_value_t = 5)]
    pub repeat: usize,
    /// Seed of the inputs and the dropout masks.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}
