"""utensil-train's networks (``--arch``): the two of its own and every model of
utensil_ffi.models (torchvision's layouts, names and state_dict keys).

    digits          nn.models.mobilenet, the small depthwise-separable CNN sized by --width
    mobilenet_v1    nn.models.mobilenet with V1_BLOCKS, sized by --width-mult
    <name>          utensil_ffi.models.get_model(name, ...), e.g. mobilenet_v3_small,
                    efficientnet_b0, mnasnet1_0, convnext_tiny; --width-mult where the family
                    has a multiplier (the MobileNets: mnasnet's alpha is fixed by its name)

``mobilenet_v2`` is torchvision's layout since run setting ``arch_version`` 2. Checkpoints
written before it (no ``arch_version`` in their run settings, read as 1) hold the flat
``nn.models.mobilenet_v2`` (keys ``"0.weight"``...): for them build_network keeps building that
flat network, so they resume, export and predict as before (no key mapping: the flat network
is rebuilt as it was saved).

Since ``arch_version`` 3 the models whose stem is a 3x3 stride-2 convolution (all but ConvNeXt,
whose 4x4 patchify stem is its design) take stem stride 1 below 96 pixels, as mobilenet_v1 and
the flat mobilenet_v2 always did: at 32 px a stride-2 stem leaves 1x1 maps for the last stages
and training diverges. Version-2 checkpoints keep stride 2 (the stride is no state_dict key, so
only the run setting tells them apart).
"""

from ..nn import models as _flat

__all__ = ["ARCH_VERSION", "arch_names", "has_width_mult", "min_image_size", "build_network",
           "describe_network", "classifier_keys", "REGULARISATION", "regularisation"]

# 1: mobilenet_v2 is nn.models' flat Sequential; 2: utensil_ffi.models' (torchvision's layout);
# 3: the zoo's small-image stem (stride 1 below 96 px)
ARCH_VERSION = 3
OWN = ("digits", "mobilenet_v1")
_WIDTH_MULT_FAMILIES = ("mobilenet",)
# stride-2 convolutions without padding: ConvNeXt's 4x4 stem and 2x2 downsamplings need 32
# pixels to keep one pixel to its last stage
_MIN_SIZE = {"convnext": 32}
_NO_STEM_STRIDE = ("convnext",)


def _zoo():
    from .. import models

    return models


def arch_names():
    """Every --arch value: utensil-train's own, then utensil_ffi.models' list_models()."""
    return OWN + tuple(n for n in _zoo().list_models() if n not in OWN)


# the builders' keywords that --dropout and --stochastic-depth-prob set (utensil-train's run
# settings of the same names; None: the builder's default)
REGULARISATION = ("dropout", "stochastic_depth_prob")


def regularisation(arch, arch_version=ARCH_VERSION):
    """Which of REGULARISATION the network of ``arch`` takes (torchvision's builder arguments):
    none for utensil-train's own networks and the flat mobilenet_v2 of arch_version 1."""
    if arch in OWN or (arch == "mobilenet_v2" and arch_version < 2):
        return ()
    import inspect

    params = inspect.signature(_zoo().get_model_builder(arch)).parameters
    return tuple(k for k in REGULARISATION if k in params)


def has_width_mult(arch):
    return arch != "digits" and arch.startswith(_WIDTH_MULT_FAMILIES)


def min_image_size(arch):
    for family, size in _MIN_SIZE.items():
        if arch.startswith(family):
            return size
    return 1


def build_network(run, image_shape, num_classes, device):
    """The network a run's settings describe (train, utensil-export and utensil-predict build
    it alike, so a checkpoint's state_dict fits)."""
    c, h, w = image_shape
    arch = run.get("arch", "digits")
    if arch == "digits":
        return _flat.mobilenet(c, num_classes, run["width"], device=device)
    stem = 1 if min(h, w) < 96 else 2  # small images would shrink to 1x1 long before the head
    if arch == "mobilenet_v1":  # models.mobilenet_v1 with the stem's stride chosen
        return _flat.mobilenet(c, num_classes, int(round(32 * run["width_mult"])),
                               _flat.V1_BLOCKS, device=device, stem_stride=stem, fused=True)
    if arch == "mobilenet_v2" and run.get("arch_version", 1) < 2:
        return _flat.mobilenet_v2(num_classes, run["width_mult"], c, device=device, fused=True,
                                  stem_stride=stem)
    kw = {"num_classes": num_classes, "in_channels": c, "device": device}
    if has_width_mult(arch):
        kw["width_mult"] = run["width_mult"]
    if run.get("arch_version", 1) >= 3 and not arch.startswith(_NO_STEM_STRIDE):
        kw["stem_stride"] = stem
    for k in regularisation(arch, run.get("arch_version", 1)):
        if run.get(k) is not None:
            kw[k] = run[k]
    return _zoo().get_model(arch, **kw)


def describe_network(run):
    arch = run.get("arch", "digits")
    if arch == "digits":
        return "depthwise-separable CNN, width %d" % run["width"]
    if arch == "mobilenet_v2" and run.get("arch_version", 1) < 2:
        return "mobilenet_v2 (utensil's flat layout), width multiplier %g" % run["width_mult"]
    words = [arch]
    if has_width_mult(arch):
        words.append("width multiplier %g" % run["width_mult"])
    words += ["%s %g" % (k.replace("_", " "), run[k]) for k in REGULARISATION
              if run.get(k) is not None]
    return ", ".join(words)


def classifier_keys(state):
    """The keys of the last Linear layer in a state_dict's order: the weight of the last 2-D
    ``weight`` entry, and the bias beside it (the classifier, whatever the family names it)."""
    last = None
    for k, v in state.items():
        if k.endswith("weight") and len(getattr(v, "shape", ())) == 2:
            last = k
    if last is None:
        return []
    bias = last[:-len("weight")] + "bias"
    return [last] + ([bias] if bias in state else [])
