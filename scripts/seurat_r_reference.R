# R Seurat reference for tests/fixtures/seurat/r_seurat_syn1200.json (run once, not in CI).
#
# Needs R with Seurat (here: Debian bookworm's r-cran-seurat 4.3.0-1, `apt-get install
# --no-install-recommends r-cran-seurat`) and the CI venv for the export and the scores:
#
#   py=~/.cache/scfoundry/venv-ci/bin/python; mkdir -p /tmp/rs && cd /tmp/rs
#   $py $REPO/scripts/make_synthetic.py --cells 1200 --genes 1000 --batches 3 --types 5 --seed 2 --out syn.h5ad
#   $py -c "import anndata as ad, scipy.io, scipy.sparse as sp; a = ad.read_h5ad('syn.h5ad'); \
#       scipy.io.mmwrite('counts.mtx', sp.csr_matrix(a.X).T.tocoo()); \
#       open('genes.txt', 'w').write('\n'.join(a.var_names) + '\n'); \
#       open('cells.txt', 'w').write('\n'.join(a.obs_names) + '\n'); a.obs[['batch', 'cell_type']].to_csv('obs.csv')"
#   Rscript $REPO/scripts/seurat_r_reference.R          # writes r_pca.csv, r_features.txt, prints anchors
#   # put r_pca.csv into obsm['X_seurat_r'] of syn.h5ad (pandas), then
#   scfoundry benchmark -d syn.h5ad -e X_seurat_r --label-key cell_type --batch-key batch
#
# Standard Seurat v3 workflow with defaults: per batch NormalizeData + FindVariableFeatures(vst,
# 2000), FindIntegrationAnchors(dims = 1:30), IntegrateData(dims = 1:30), ScaleData, RunPCA(30).
suppressMessages({library(Seurat); library(Matrix)})
m <- readMM("counts.mtx"); m <- as(m, "CsparseMatrix")
rownames(m) <- readLines("genes.txt"); colnames(m) <- readLines("cells.txt")
obs <- read.csv("obs.csv", row.names = 1)
so <- CreateSeuratObject(m, meta.data = obs)
l <- SplitObject(so, split.by = "batch")
l <- lapply(l, function(x) { x <- NormalizeData(x, verbose = FALSE); FindVariableFeatures(x, nfeatures = 2000, verbose = FALSE) })
t0 <- Sys.time()
anc <- FindIntegrationAnchors(l, dims = 1:30, verbose = FALSE)
int <- IntegrateData(anc, dims = 1:30, verbose = FALSE)
int <- ScaleData(int, verbose = FALSE); int <- RunPCA(int, npcs = 30, verbose = FALSE)
cat("seconds", as.numeric(Sys.time() - t0, units = "secs"), "\n")
cat("anchors", nrow(anc@anchors) / 2, "\n")
emb <- Embeddings(int, "pca")[colnames(m), ]
write.csv(emb, "r_pca.csv")
writeLines(anc@anchor.features, "r_features.txt")
