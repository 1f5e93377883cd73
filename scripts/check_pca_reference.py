#!/usr/bin/env python3
"""Independent float64 numpy re-implementation of the scanpy recipe, checked against
scripts/scanpy_pca_reference.py output. It is a readable spec of what scanpy does:

    python scripts/check_pca_reference.py IN.h5ad REF.json N_TOP_GENES

normalize_total(1e4) -> log1p -> seurat HVG (expm1, mean/var ddof=1, mean==0 -> 1e-12,
dispersion = var/mean, 0 -> NaN, log; mean -> log1p(mean); 20 equal-width bins as pd.cut:
linspace(min, max, 21) with edges[0] -= 0.1% of the range, right-closed (a, b];
per-bin mean and std (ddof=1) over non-NaN dispersions; a bin with ONE non-NaN gene gets
avg=0, dev=its dispersion (so its norm is 1); hvg = disp_norm >= n-th highest non-NaN
disp_norm (ties all kept)) -> exact dense PCA on the centred HVG columns.
"""
import json, sys, numpy as np, anndata as ad, scipy.sparse as sp, warnings
warnings.filterwarnings("ignore")
f, ref, ntop = sys.argv[1], sys.argv[2], int(sys.argv[3])
r = json.load(open(ref))
a = ad.read_h5ad(f)
X = sp.csr_matrix(a.X, dtype=np.float64)
tot = np.asarray(X.sum(1)).ravel()
X = sp.diags(1e4/tot) @ X
X.data = np.log1p(X.data)
E = X.copy(); E.data = np.expm1(E.data)
n = X.shape[0]
mean = np.asarray(E.mean(0)).ravel()
var = (np.asarray(E.multiply(E).mean(0)).ravel() - mean**2) * n/(n-1)
mean[mean==0] = 1e-12
disp = var/mean
disp[disp==0] = np.nan
with np.errstate(all='ignore'):
    disp = np.log(disp)
lm = np.log1p(mean)
mn, mx = lm.min(), lm.max()
edges = np.linspace(mn, mx, 21); edges[0] -= (mx-mn)*0.001
b = np.clip(np.searchsorted(edges, lm, side='left') - 1, 0, 19)  # right-closed bins (a,b]
dn = np.full_like(disp, np.nan)
for k in range(20):
    sel = b==k; d = disp[sel]; d = d[~np.isnan(d)]
    if d.size == 0: continue
    if d.size == 1: avg, dev = 0.0, d[0]
    else: avg, dev = d.mean(), d.std(ddof=1)
    dn[sel] = (disp[sel]-avg)/dev
fin = dn[~np.isnan(dn)]
nt = min(ntop, len(dn), fin.size)
cut = np.sort(fin)[::-1][nt-1]
hv = np.nan_to_num(dn, nan=-np.inf) >= cut
refidx = np.array(r['hvg_indices'])
print('bins equal', np.array_equal(b, np.array(r['mean_bin'])), 'edges maxdiff', np.abs(edges-np.array(r['mean_bin_edges'])).max())
rdn = np.array([np.nan if v is None else v for v in r['dispersions_norm']])
ok = ~np.isnan(rdn)
print('nan pattern equal', np.array_equal(np.isnan(dn), np.isnan(rdn)), 'max |dn diff|', np.abs(dn[ok]-rdn[ok]).max())
print('hvg equal', np.array_equal(np.flatnonzero(hv), refidx), hv.sum(), len(refidx), 'cutoff', cut, r['disp_cutoff'])
srt = np.sort(fin)[::-1]; print('gap at cutoff (nth - n+1th):', srt[nt-1]-srt[nt] if nt < fin.size else None, 'n nan disp_norm', np.isnan(dn).sum())
# PCA dense float64
Xh = X[:, refidx].toarray(); mu = Xh.mean(0); Xc = Xh-mu
U,S,Vt = np.linalg.svd(Xc, full_matrices=False)
k = r['meta']['n_comps']
ev = S[:k]**2/(n-1); tv = (Xc**2).sum()/(n-1)
rv = np.array(r['variance']); rr = np.array(r['variance_ratio'])
print('variance max rel diff', np.abs(ev/rv-1).max(), 'ratio max abs diff', np.abs(ev/tv-rr).max(), 'total var', tv, r['total_variance'])
C = np.array(r['components'])
# principal angles
Q1,_ = np.linalg.qr(C.T); Q2,_ = np.linalg.qr(Vt[:k].T)
s = np.linalg.svd(Q1.T@Q2, compute_uv=False); print('subspace min cos', s.min(), 'per-comp |cos| first 10', np.round(np.abs((C*Vt[:k]).sum(1))[:10],6))
# sign convention: max-abs entry of each component positive
print('max-abs entry positive in ref', np.all(C[np.arange(k), np.abs(C).argmax(1)] > 0))
Xp = np.array(r['x_pca']); print('x_pca vs Xc@C.T max abs diff', np.abs(Xp - Xc@C.T).max(), 'scale', np.abs(Xp).max())
