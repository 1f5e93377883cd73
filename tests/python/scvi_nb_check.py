"""Negative binomial log-likelihood as scvi-tools writes it (`log_nb_positive`, mean/inverse-
dispersion parametrisation, eps=1e-8), in plain Python (math.lgamma) on a fixed grid, and the
same value from scipy.stats.nbinom (n = theta, p = theta / (theta + mu)) as a second opinion.
Prints JSON: {"cases": [[x, mu, theta, logp_formula, logp_scipy], ...]}."""
import json
import math

from scipy.stats import nbinom


def log_nb_positive(x, mu, theta, eps=1e-8):
    log_theta_mu_eps = math.log(theta + mu + eps)
    return (
        theta * (math.log(theta + eps) - log_theta_mu_eps)
        + x * (math.log(mu + eps) - log_theta_mu_eps)
        + math.lgamma(x + theta)
        - math.lgamma(theta)
        - math.lgamma(x + 1)
    )


cases = []
for x in [0, 1, 2, 5, 17, 120, 1000]:
    for mu in [0.01, 0.7, 3.0, 25.0, 400.0]:
        for theta in [0.05, 0.5, 2.0, 30.0, 1e4]:
            cases.append([x, mu, theta, log_nb_positive(x, mu, theta), float(nbinom.logpmf(x, theta, theta / (theta + mu)))])
print(json.dumps({"cases": cases}))
