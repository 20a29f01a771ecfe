"""Layer 6: jobs as Kubernetes pods — a master pod (coordinator + pod manager) and worker pods.

``elasticdl-strategy k8s submit --name J --image I --workers N -- python train.py`` creates
the objects of :mod:`~elasticdl_strategy.launcher.k8s.manifests`; the master
(:mod:`~elasticdl_strategy.launcher.k8s.master`) creates and watches the worker pods
(:mod:`~elasticdl_strategy.launcher.k8s.pod_manager`).
"""
