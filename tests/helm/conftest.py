import pytest

from tests.helm.chart import VARIANTS, Rendered, render


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request) -> Rendered:
    """The chart rendered with each value set of VARIANTS."""
    return render(VARIANTS[request.param])
