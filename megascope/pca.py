"""PCA of a hook's vectors over all tokens of all prompts, to 2-D, computed on the server."""

import torch


def pca_2d(vectors):
    """vectors [n, ...] (tensor or numpy array) -> (coords [n, 2], explained_variance_ratio [2]), float32 tensors.

    Centered, then SVD in float64. Each component's sign is fixed so that its largest-magnitude loading
    is positive: the same data gives the same picture on every call. Missing components (n < 3 or
    d < 2) are zeros."""
    data = torch.as_tensor(vectors)
    data = data.reshape(data.shape[0], -1).double()
    centered = data - data.mean(dim=0, keepdim=True)
    _, singular, right = torch.linalg.svd(centered, full_matrices=False)
    count = min(2, singular.numel())
    components = right[:count]
    signs = torch.sign(components.gather(1, components.abs().argmax(dim=1, keepdim=True)))
    components = components * torch.where(signs == 0, 1.0, signs)
    coords = torch.zeros(data.size(0), 2, dtype=torch.float64)
    coords[:, :count] = centered @ components.T
    variance = singular.square()
    ratio = torch.zeros(2, dtype=torch.float64)
    total = variance.sum()
    if total > 0:
        ratio[:count] = variance[:count] / total
    return coords.float(), ratio.float()
