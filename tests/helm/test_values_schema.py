"""Bad values fail at install with a message naming the value: values.schema.json for types,
ranges and typos, the chart's own checks for combinations."""

from __future__ import annotations

import re

import pytest
from helm_python.errors import HelmRenderError, HelmValuesError

from tests.helm.chart import VARIANTS, chart, render


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_pass_the_schema(variant):
    chart().validate_schema(VARIANTS[variant])


@pytest.mark.parametrize("values, message", [
    ({"workers": {"tp": 3}}, "at '/workers/tp': value must be one of 1, 2, 4, 8"),
    ({"workers": {"tp": 0}}, "at '/workers/tp'"),
    ({"workers": {"device": "rocm"}}, "at '/workers/device': value must be one of 'cuda', 'cpu'"),
    ({"workers": {"replicas": "2"}}, "at '/workers/replicas': got string, want integer"),
    ({"workers": {"engine": {"max-num-seq": 64}}},
     "at '/workers/engine': additional properties 'max-num-seq' not allowed"),
    ({"workers": {"engine": {"kv-cache-memory": "a lot"}}}, "at '/workers/engine/kv-cache-memory'"),
    ({"workers": {"engine": {"dtype": "fp8"}}}, "at '/workers/engine/dtype'"),
    ({"workers": {"engine": {"speculative": "medusa"}}}, "at '/workers/engine/speculative'"),
    ({"workers": {"engine": {"num-speculative-tokens": 17}}}, "at '/workers/engine/num-speculative-tokens'"),
    ({"workers": {"shmSize": "big"}}, "at '/workers/shmSize'"),
    ({"workers": {"modelMountPath": "models"}}, "at '/workers/modelMountPath'"),
    ({"workers": {"kuberay": {"rayVersion": "latest"}}}, "at '/workers/kuberay/rayVersion'"),
    ({"worker": {"replicas": 1}}, "at '': additional properties 'worker' not allowed"),
    ({"router": {"policy": "fastest"}}, "at '/router/policy': value must be one of"),
    ({"router": {"grpcPort": 70000}}, "at '/router/grpcPort'"),
    ({"router": {"httpWorkers": 0}}, "at '/router/httpWorkers'"),
    ({"router": {"autoscaling": {"targetCPUUtilizationPercentage": 150}}}, "targetCPUUtilizationPercentage"),
    ({"router": {"apiKeys": {"keys": ["a,b"]}}}, "at '/router/apiKeys/keys/0'"),
    ({"redis": {"external": {"url": "http://redis:6379"}}}, "at '/redis/external/url'"),
    ({"redis": {"bundled": {"auth": {"password": "hunter2"}}}}, "additional properties 'password' not allowed"),
    ({"serviceMonitor": {"interval": "30 seconds"}}, "at '/serviceMonitor/interval'"),
    ({"router": {"tls": {"secret": "router-tls"}}}, "at '/router/tls': additional properties 'secret' not allowed"),
    ({"router": {"limits": {"rateLimit": -1}}}, "at '/router/limits/rateLimit'"),
    ({"router": {"limits": {"rateBurst": 1.5}}}, "at '/router/limits/rateBurst'"),
    ({"router": {"limits": {"maxConcurrent": 4}}}, "additional properties 'maxConcurrent' not allowed"),
    ({"router": {"metrics": {"protect": "yes"}}}, "at '/router/metrics/protect'"),
    ({"router": {"metrics": {"scrapeKeySecret": {"name": "s", "key": ""}}}},
     "at '/router/metrics/scrapeKeySecret/key'"),
    ({"serviceMonitor": {"tls": {"insecure": True}}}, "additional properties 'insecure' not allowed"),
])  # fmt: skip
def test_schema_refuses(values, message):
    with pytest.raises(HelmValuesError) as err:
        chart().validate_schema(values)
    assert message in str(err.value)
    with pytest.raises(HelmValuesError, match="values don't meet the specifications"):
        render(values)  # an install renders: it fails the same way


@pytest.mark.parametrize("values, message", [
    ({"redis": {"bundled": {"enabled": False}}}, "set redis.external.url"),
    ({"redis": {"external": {"url": "redis://r:6379/0"}}}, "set redis.bundled.enabled=false to use redis.external"),
    ({"redis": {"bundled": {"enabled": False},
                "external": {"url": "redis://r/0", "urlKey": "url", "existingSecret": "s"}}},
     "set url or urlKey, not both"),
    ({"redis": {"bundled": {"enabled": False}, "external": {"url": "redis://r/0", "passwordKey": "pw"}}},
     "redis.external.existingSecret, which is empty"),
    ({"workers": {"device": "cpu", "tp": 2}}, "workers.tp > 1 needs workers.device=cuda"),
    ({"workers": {"device": "cpu", "kuberay": {"enabled": True}}}, "it needs workers.device=cuda"),
    ({"router": {"apiKeys": {"enabled": True}}}, "router.apiKeys.existingSecret or list router.apiKeys.keys"),
    ({"router": {"tls": {"enabled": True}}}, "Secret (tls.crt, tls.key) in router.tls.secretName"),
    ({"router": {"limits": {"rateBurst": 10}}}, "rateBurst is a burst above router.limits.rateLimit"),
    ({"router": {"limits": {"rateLimit": 0, "rateBurst": 10}}}, "set rateLimit too"),
    ({"router": {"metrics": {"protect": True}}}, "router.metrics.protect checks /metrics against the API keys"),
    ({"router": {"apiKeys": {"enabled": True, "keys": ["key-one-123"]}, "metrics": {"protect": True}},
      "serviceMonitor": {"enabled": True}},
     "name the Secret holding Prometheus's API key in router.metrics.scrapeKeySecret.name"),
    ({"serviceMonitor": {"tls": {"insecureSkipVerify": True, "caSecret": {"name": "ca"}}}},
     "set caSecret (verify the router's certificate) or insecureSkipVerify, not both"),
])  # fmt: skip
def test_chart_refuses_combinations(values, message):
    chart().validate_schema(values)  # each value is fine alone
    with pytest.raises(HelmRenderError, match=re.escape(message)):
        render(values)
