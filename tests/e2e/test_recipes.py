"""docs/recipes.md, run: the route blocks of the page, read from it, in one real gateway in front
of a fake vendor (tests/e2e/vendor.py), each driven by its vendor's real SDK.

For every SDK: its own call is performed once; the same call with the same key is replayed; another
body under that key is refused, and the SDK raises its own error showing the problem; the POSTs
it sends without a key (tokens, searches, lookups, updates) pass. Where a recipe chooses its scope
headers for a reason, the reason is tested too.
"""

from __future__ import annotations

import contextvars
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import Adyen
import gocardless_pro
import httpx
import increase
import modern_treasury
import pytest
import requests
import square
import square.core.api_error
import stripe
import yaml
from Adyen import exceptions as adyen_errors
from checkout_sdk.checkout_sdk import CheckoutSdk
from checkout_sdk.environment import Environment as CheckoutEnvironment
from checkout_sdk.exception import CheckoutApiException
from checkout_sdk.payments.payments import PaymentRequest, PaymentsSearchRequest
from gocardless_pro import errors as gocardless_errors
from paypalserversdk.configuration import Configuration, Environment, Server
from paypalserversdk.exceptions.error_exception import ErrorException
from paypalserversdk.http.auth.o_auth_2 import ClientCredentialsAuthCredentials
from paypalserversdk.models.amount_with_breakdown import AmountWithBreakdown
from paypalserversdk.models.checkout_payment_intent import CheckoutPaymentIntent
from paypalserversdk.models.order_request import OrderRequest
from paypalserversdk.models.purchase_unit_request import PurchaseUnitRequest
from paypalserversdk.paypal_serversdk_client import PaypalServersdkClient
from twilio.base.exceptions import TwilioRestException
from twilio.http.http_client import TwilioHttpClient
from twilio.rest import Client as TwilioClient

from tests.e2e.conftest import DemoUpstream, GatewayProcess
from tests.helpers import new_key, total

RECIPES = Path(__file__).parents[2] / "docs" / "recipes.md"
# Each vendor's address in the recipes, and the folder of the fake vendor that plays it.
VENDORS = {
    "https://api.stripe.com": "stripe",
    "https://api.gocardless.com": "gocardless",
    "https://api.increase.com": "increase",
    "https://app.moderntreasury.com": "modern-treasury",
    "https://connect.squareup.com": "square",
    "https://checkout-test.adyen.com": "adyen",
    "https://api-m.paypal.com": "paypal",
    "https://1a2b3c4d.api.checkout.com": "checkout",
    "https://api.twilio.com": "twilio",
}
# Not a recipe: PayPal's route with the default scope (Authorization), the control of the
# recipe's choice.
PAYPAL_BY_TOKEN = "/paypal-by-token"


def recipe_routes() -> list[dict[str, Any]]:
    """Every route of the page's YAML blocks, as written."""
    blocks = re.findall(r"```yaml\n(.*?)```", RECIPES.read_text(), re.S)
    return [route for block in blocks for route in yaml.safe_load(block)["routes"]]


def played_by(vendor: DemoUpstream, routes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The routes with each vendor's address replaced by the fake vendor's folder for it."""
    played = []
    for route in routes:
        [host] = [host for host in VENDORS if route["upstream"].startswith(host)]
        upstream = vendor.url + "/" + VENDORS[host] + route["upstream"].removeprefix(host)
        played.append({**route, "upstream": upstream})
    return played


@pytest.fixture(scope="module")
def vendor(module_dir: Path) -> Iterator[DemoUpstream]:
    with DemoUpstream(module_dir, program=("-m", "tests.e2e.vendor"), name="vendor") as started:
        yield started


@pytest.fixture(scope="module")
def gateway(module_dir: Path, database_url: str, vendor: DemoUpstream) -> Iterator[GatewayProcess]:
    [paypal] = [route for route in recipe_routes() if route["name"] == "paypal"]
    by_token = {**paypal, "name": "paypal-by-token", "match": PAYPAL_BY_TOKEN}
    del by_token["scope_headers"]
    routes = played_by(vendor, [*recipe_routes(), by_token])
    with GatewayProcess(module_dir, database_url, routes) as started:
        yield started


class Outcomes:
    """How the gateway answered one route's requests since this was made (its metrics)."""

    def __init__(self, gateway: GatewayProcess, route: str) -> None:
        self.gateway, self.route = gateway, route
        self.before = self._read()

    def _read(self) -> str:
        return httpx.get(self.gateway.admin_url + "/metrics").text

    def counts(self) -> dict[str, int]:
        now = self._read()
        counted = {}
        for outcome in ("forwarded", "replayed", "mismatch", "unprotected", "passthrough",
                        "missing_key"):  # fmt: skip
            labels = {"route": self.route, "outcome": outcome}
            change = total(now, "oncegate_requests_total", **labels) - total(
                self.before, "oncegate_requests_total", **labels
            )
            if change:
                counted[outcome] = int(change)
        return counted


def test_every_recipe_names_a_vendor_this_test_plays_and_a_route_of_its_own() -> None:
    routes = recipe_routes()
    names = [route["name"] for route in routes]
    assert len(names) == len(set(names))
    assert len({route["match"] for route in routes}) == len(routes)
    assert {VENDORS[host] for host in VENDORS} == {
        VENDORS[host] for route in routes for host in VENDORS if route["upstream"].startswith(host)
    }


# -- SDKs that put a key on every POST ---------------------------------------------------------


def test_stripe(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    client = stripe.StripeClient(
        "sk_test_recipes", base_addresses={"api": gateway.url + "/stripe"}, max_network_retries=2
    )
    marker, key = uuid.uuid4().hex, new_key()
    params: dict[str, Any] = {"amount": 500, "currency": "usd", "description": marker}
    outcomes = Outcomes(gateway, "stripe")
    first = client.v1.charges.create(params=params, options={"idempotency_key": key})
    again = client.v1.charges.create(params=params, options={"idempotency_key": key})
    with pytest.raises(stripe.APIError) as refused:
        client.v1.charges.create(params={**params, "amount": 501}, options={"idempotency_key": key})
    [action] = vendor.performed(marker)
    assert first.id == again.id == action["id"]
    assert again.last_response.headers["idempotent-replayed"] == "true"
    assert refused.value.http_status == 422 and "key-reused" in str(refused.value.http_body)
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1}  # no retries


def test_stripe_keys_are_per_connected_account(
    gateway: GatewayProcess, vendor: DemoUpstream
) -> None:
    """`Stripe-Account` is a scope header: one key for two connected accounts is two charges,
    as Stripe itself keys them."""
    client = stripe.StripeClient("sk_test_recipes", base_addresses={"api": gateway.url + "/stripe"})
    marker, key = uuid.uuid4().hex, new_key()
    params: dict[str, Any] = {"amount": 5, "currency": "usd", "description": marker}
    for account in ("acct_one", "acct_two", "acct_one"):
        client.v1.charges.create(
            params=params, options={"idempotency_key": key, "stripe_account": account}
        )
    performed = vendor.performed(marker)
    assert [action["headers"]["stripe-account"] for action in performed] == ["acct_one", "acct_two"]


def test_gocardless(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    client = gocardless_pro.Client(access_token="sandbox_recipes", base_url=gateway.url)
    marker, key = uuid.uuid4().hex, new_key()
    params: dict[str, Any] = {"amount": 500, "currency": "GBP", "description": marker,
                              "links": {"mandate": "MD0001"}}  # fmt: skip
    outcomes = Outcomes(gateway, "gocardless")
    first = client.payments.create(params=params, headers={"Idempotency-Key": key})
    again = client.payments.create(params=params, headers={"Idempotency-Key": key})
    with pytest.raises(gocardless_errors.GoCardlessProError) as refused:
        client.payments.create(params={**params, "amount": 501}, headers={"Idempotency-Key": key})
    [action] = vendor.performed(marker)
    assert first.id == again.id == action["id"]
    assert again.api_response.headers["idempotent-replayed"] == "true"
    assert "urn:oncegate:problem:key-reused" in str(refused.value)
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1}


def test_increase(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    client = increase.Increase(api_key="recipes", base_url=gateway.url + "/increase")
    marker, key = uuid.uuid4().hex, new_key()
    transfer: dict[str, Any] = {
        "account_id": "account_in71c4amph0vgo2qllky",
        "amount": 500,
        "description": marker,
        "destination_account_id": "account_uf16sut2ct5bevmq3eh",
    }
    outcomes = Outcomes(gateway, "increase")
    first = client.account_transfers.create(**transfer, idempotency_key=key)
    again = client.account_transfers.with_raw_response.create(**transfer, idempotency_key=key)
    with pytest.raises(increase.UnprocessableEntityError) as refused:
        client.account_transfers.create(**{**transfer, "amount": 501}, idempotency_key=key)
    # An update is a PATCH without a key: it passes (`methods: [POST]`).
    client.accounts.update("account_in71c4amph0vgo2qllky", name=marker)
    performed = vendor.performed(marker)
    assert [action["method"] for action in performed] == ["POST", "PATCH"]
    assert first.id == again.parse().id == performed[0]["id"]
    assert again.headers["idempotent-replayed"] == "true" and again.retries_taken == 0
    assert refused.value.body["type"] == "urn:oncegate:problem:key-reused"  # type: ignore[index]
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1, "passthrough": 1}


def test_modern_treasury(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    client = modern_treasury.ModernTreasury(
        organization_id="org", api_key="recipes", base_url=gateway.url + "/modern-treasury"
    )
    marker, key = uuid.uuid4().hex, new_key()
    order: dict[str, Any] = {"amount": 500, "direction": "credit", "type": "ach",
                             "originating_account_id": "0f8e3719-3dfd-4613-9bbf-c0333781b59f",
                             "description": marker}  # fmt: skip
    outcomes = Outcomes(gateway, "modern-treasury")
    first = client.payment_orders.create(**order, idempotency_key=key)
    again = client.payment_orders.with_raw_response.create(**order, idempotency_key=key)
    with pytest.raises(modern_treasury.UnprocessableEntityError) as refused:
        client.payment_orders.create(**{**order, "amount": 501}, idempotency_key=key)
    client.counterparties.update("cp_1", name=marker)  # PATCH, no key: passes
    performed = vendor.performed(marker)
    assert [action["method"] for action in performed] == ["POST", "PATCH"]
    assert first.id == again.parse().id == performed[0]["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1, "passthrough": 1}


# -- SDKs whose key the caller passes, beside POSTs that carry none ----------------------------


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    """An httpx client closed after the test, for the SDKs that would leave theirs open."""
    with httpx.Client(timeout=30) as client:
        yield client


def test_square(gateway: GatewayProcess, vendor: DemoUpstream, http: httpx.Client) -> None:
    client = square.Square(
        token="EAAA-recipes", base_url=gateway.url + "/square", httpx_client=http
    )
    marker, key = uuid.uuid4().hex, new_key()
    payment: dict[str, Any] = {"source_id": "cnon:card-nonce-ok", "note": marker,
                               "amount_money": {"amount": 100, "currency": "USD"}}  # fmt: skip
    outcomes = Outcomes(gateway, "square")
    first = client.payments.create(**payment, idempotency_key=key)
    again = client.payments.with_raw_response.create(**payment, idempotency_key=key)
    with pytest.raises(square.core.api_error.ApiError) as refused:
        client.payments.create(
            **{**payment, "amount_money": {"amount": 101, "currency": "USD"}}, idempotency_key=key
        )
    # No key: the OAuth token and a search pass.
    token = client.o_auth.obtain_token(client_id="sq0idp-recipes", grant_type="client_credentials")
    client.orders.search(location_ids=["L1"])
    [action] = vendor.performed(marker)
    assert first.payment is not None and again.data.payment is not None
    assert first.payment.id == again.data.payment.id == action["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert refused.value.status_code == 422
    assert isinstance(refused.value.body, dict) and refused.value.body["status"] == 422
    assert token.access_token is not None and token.access_token.startswith("tok-")
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1, "unprotected": 2}


def test_adyen(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    adyen = Adyen.Adyen(xapikey="AQE-recipes", platform="test")
    adyen.checkout.payments_api.baseUrl = gateway.url + "/adyen/v72"
    marker, key = uuid.uuid4().hex, new_key()
    request: dict[str, Any] = {
        "amount": {"currency": "EUR", "value": 1000},
        "reference": marker,
        "merchantAccount": "Recipes",
        "paymentMethod": {"type": "scheme"},
    }
    payments = Outcomes(gateway, "adyen-payments")
    others = Outcomes(gateway, "adyen")
    first = adyen.checkout.payments_api.payments(request, idempotency_key=key)
    again = adyen.checkout.payments_api.payments(request, idempotency_key=key)
    with pytest.raises(adyen_errors.AdyenAPIUnprocessableEntity) as refused:
        adyen.checkout.payments_api.payments({**request, "reference": marker + "-2"}, key)
    # A payment without a key is refused; the payment methods pass without one.
    with pytest.raises(adyen_errors.AdyenAPIValidationError) as unkeyed:
        adyen.checkout.payments_api.payments(request)
    adyen.checkout.payments_api.payment_methods({"merchantAccount": "Recipes"})
    [action] = vendor.performed(marker)
    assert first.message["pspReference"] == again.message["pspReference"] == action["id"]
    assert action["headers"]["x-api-key"] == "AQE-recipes"
    assert refused.value.status_code == 422
    assert unkeyed.value.status_code == 400 and "missing-key" in str(unkeyed.value.message)
    assert payments.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1, "missing_key": 1}
    assert others.counts() == {"unprotected": 1}


def test_adyen_keys_are_per_api_key(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    """The SDK authenticates with `X-API-KEY`, not `Authorization`: the recipe's scope header."""
    marker, key = uuid.uuid4().hex, new_key()
    request: dict[str, Any] = {"amount": {"currency": "EUR", "value": 1}, "reference": marker,
                               "merchantAccount": "Recipes"}  # fmt: skip
    for api_key in ("AQE-one", "AQE-two"):
        adyen = Adyen.Adyen(xapikey=api_key, platform="test")
        adyen.checkout.payments_api.baseUrl = gateway.url + "/adyen/v72"
        adyen.checkout.payments_api.payments(request, idempotency_key=key)
    assert len(vendor.performed(marker)) == 2


def paypal_client(
    gateway: GatewayProcess, prefix: str = "/paypal", timeout: int = 60
) -> PaypalServersdkClient:
    config = Configuration(
        client_credentials_auth_credentials=ClientCredentialsAuthCredentials(
            o_auth_client_id="recipes-id", o_auth_client_secret="recipes-secret"
        ),
        environment=Environment.PRODUCTION,
        timeout=timeout,
    )
    config.environments = {Environment.PRODUCTION: {Server.DEFAULT: gateway.url + prefix}}
    return PaypalServersdkClient(config=config)


def paypal_order(marker: str, value: str = "10.00") -> OrderRequest:
    return OrderRequest(
        intent=CheckoutPaymentIntent.CAPTURE,
        purchase_units=[PurchaseUnitRequest(
            amount=AmountWithBreakdown(currency_code="USD", value=value), custom_id=marker)],
    )  # fmt: skip


def test_paypal(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    client = paypal_client(gateway)
    marker, key = uuid.uuid4().hex, new_key()
    outcomes = Outcomes(gateway, "paypal")
    create = client.orders.create_order
    first = create({"body": paypal_order(marker), "paypal_request_id": key})
    again = create({"body": paypal_order(marker), "paypal_request_id": key})
    with pytest.raises(ErrorException) as refused:
        create({"body": paypal_order(marker, "11.00"), "paypal_request_id": key})
    [action] = vendor.performed(marker)
    assert first.body.id == again.body.id == action["id"]
    assert again.headers["idempotent-replayed"] == "true"
    assert action["headers"]["paypal-request-id"] == key
    assert action["headers"]["authorization"] == "Bearer " + first_token(vendor, action)
    assert refused.value.response_code == 422
    assert refused.value.message is not None and "different request" in refused.value.message
    # The token the SDK fetched first passed without a key.
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1, "unprotected": 1}


def first_token(vendor: DemoUpstream, action: dict[str, Any]) -> str:
    token = action["headers"]["authorization"].removeprefix("Bearer ")
    assert token.startswith("tok-")  # one the fake vendor handed out
    return token


def test_paypal_captures_require_a_request_id(gateway: GatewayProcess) -> None:
    with pytest.raises(ErrorException) as refused:
        paypal_client(gateway).payments.capture_authorized_payment({"authorization_id": "AU1"})
    assert refused.value.response_code == 400
    assert refused.value.message is not None and "PayPal-Request-Id" in refused.value.message


@pytest.mark.parametrize(
    ("prefix", "performed"), [("/paypal", 1), (PAYPAL_BY_TOKEN, 2)], ids=["recipe", "by-token"]
)
def test_paypal_after_a_token_refresh(
    gateway: GatewayProcess, vendor: DemoUpstream, prefix: str, performed: int
) -> None:
    """A retry from a client holding another token (a refresh between the attempt and its
    retry, or another process): the recipe's scope replays it; scoped by `Authorization`, the
    default, it is a second order."""
    marker, key = uuid.uuid4().hex, new_key()
    for _ in range(2):  # each client fetches a token of its own
        paypal_client(gateway, prefix).orders.create_order(
            {"body": paypal_order(marker), "paypal_request_id": key}
        )
    actions = vendor.performed(marker)
    assert len(actions) == performed
    tokens = {action["headers"]["authorization"] for action in actions}
    assert len(tokens) == performed


CHECKOUT_KEY = "sk_sbox_m73dzbpy7cf3gfd46xr4yj5xo4e"


def checkout_api(gateway: GatewayProcess) -> Any:
    sandbox = CheckoutEnvironment.sandbox()
    environment = CheckoutEnvironment(
        gateway.url + "/checkout/", sandbox.authorization_uri, sandbox.files_uri,
        sandbox.transfers_uri, sandbox.balances_uri, sandbox.forward_uri, sandbox.identity_uri,
        True,
    )  # fmt: skip
    builder = CheckoutSdk.builder().secret_key(CHECKOUT_KEY).environment(environment)
    # The SDK would put the merchant's subdomain in front of the gateway's host: the gateway's
    # route names it instead (docs/recipes.md). Both this and building the SDK (its risk
    # module) warn of deprecations.
    with (
        pytest.warns(DeprecationWarning, match="use_legacy_domain"),
        pytest.warns(DeprecationWarning, match="Risk endpoints"),
    ):
        return builder.use_legacy_domain().build()


def checkout_payment(marker: str, amount: int = 1000) -> PaymentRequest:
    request = PaymentRequest()
    request.amount, request.currency, request.reference = amount, "GBP", marker
    return request


def test_checkout(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    api = checkout_api(gateway)
    marker, key = uuid.uuid4().hex, new_key()
    outcomes = Outcomes(gateway, "checkout-payments")
    first = api.payments.request_payment(checkout_payment(marker), key)
    again = api.payments.request_payment(checkout_payment(marker), key)
    with pytest.raises(CheckoutApiException) as refused:
        api.payments.request_payment(checkout_payment(marker, 1001), key)
    with pytest.raises(CheckoutApiException) as unkeyed:
        api.payments.request_payment(checkout_payment(marker))
    search = PaymentsSearchRequest()
    search.query = f"reference:{marker}"
    searches = Outcomes(gateway, "checkout-payments-search")
    api.payments.search_payments(search)
    [action] = vendor.performed(marker)
    assert first.id == again.id == action["id"]
    assert again.http_metadata.headers["idempotent-replayed"] == "true"
    assert action["headers"]["cko-idempotency-key"] == key
    assert refused.value.http_metadata.status_code == 422
    assert unkeyed.value.http_metadata.status_code == 400
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1, "missing_key": 1}
    assert searches.counts() == {"unprotected": 1}


# The key of the Twilio call in hand (docs/recipes.md).
idempotency_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "idempotency_key", default=None
)


class GatewayClient(TwilioHttpClient):
    """Sends the REST API's calls through the gateway, with the key of the call in hand."""

    def __init__(self, gateway: str) -> None:
        super().__init__()
        self.gateway = gateway

    def request(  # type: ignore[no-untyped-def]
        self, method, url, params=None, data=None, headers=None, auth=None, timeout=None,
        allow_redirects=False,
    ):  # fmt: skip
        url = url.replace("https://api.twilio.com", self.gateway + "/twilio", 1)
        key = idempotency_key.get()
        if key is not None:
            headers = {**(headers or {}), "Idempotency-Key": key}
        return super().request(method, url, params, data, headers, auth, timeout, allow_redirects)


def test_twilio(gateway: GatewayProcess, vendor: DemoUpstream) -> None:
    client = TwilioClient("AC" + "0" * 32, "recipes", http_client=GatewayClient(gateway.url))
    marker, key = uuid.uuid4().hex, new_key()
    message: dict[str, Any] = {"to": "+15550100", "from_": "+15550199", "body": marker}
    outcomes = Outcomes(gateway, "twilio")
    marked = idempotency_key.set(key)
    try:
        first = client.messages.create(**message)
        again = client.messages.create(**message)
        with pytest.raises(TwilioRestException) as refused:
            client.messages.create(**{**message, "to": "+15550101"})
    finally:
        idempotency_key.reset(marked)
    unmarked = client.messages.create(**{**message, "body": marker + " unmarked"})
    performed = vendor.performed(marker)
    assert first.sid == again.sid == performed[0]["id"]
    assert unmarked.sid == performed[1]["id"] and len(performed) == 2
    assert refused.value.status == refused.value.code == 422
    assert "different request" in refused.value.msg
    assert outcomes.counts() == {"forwarded": 1, "replayed": 1, "mismatch": 1, "unprotected": 1}


# -- `wait`: a retry after a timeout gets the first answer ------------------------------------

# The SDK gives up on an attempt after this long; the fake vendor answers later, so the retry
# finds the key in flight, and the route's `wait` holds it until the first answer exists.
TIMEOUT = 2
SLOW = f"vendor-delay-{TIMEOUT + 1}"


def test_modern_treasury_retries_after_its_timeout_and_gets_the_first_answer(
    gateway: GatewayProcess, vendor: DemoUpstream
) -> None:
    """The SDK's own retry, with the key it drew."""
    client = modern_treasury.ModernTreasury(
        organization_id="org", api_key="recipes", base_url=gateway.url + "/modern-treasury",
        timeout=TIMEOUT, max_retries=2,
    )  # fmt: skip
    marker = uuid.uuid4().hex
    raw = client.payment_orders.with_raw_response.create(
        amount=1, direction="credit", type="ach", description=f"{marker} {SLOW}",
        originating_account_id="0f8e3719-3dfd-4613-9bbf-c0333781b59f",
    )  # fmt: skip
    [action] = vendor.performed(marker)
    assert raw.parse().id == action["id"] and raw.retries_taken >= 1
    assert raw.headers["idempotent-replayed"] == "true"
    assert action["headers"]["idempotency-key"].startswith("stainless-python-retry-")


def test_paypal_retried_by_the_application_after_a_timeout_gets_the_first_answer(
    gateway: GatewayProcess, vendor: DemoUpstream
) -> None:
    """PayPal's SDK retries no POST: the application does, with the same request id."""
    client = paypal_client(gateway, timeout=TIMEOUT)
    marker, key = uuid.uuid4().hex, new_key()
    order = {"body": paypal_order(f"{marker} {SLOW}"), "paypal_request_id": key}
    with pytest.raises(requests.exceptions.Timeout):
        client.orders.create_order(order)
    again = client.orders.create_order(order)
    [action] = vendor.performed(marker)
    assert again.body.id == action["id"]
    assert again.headers["idempotent-replayed"] == "true"


def test_square_retried_by_the_application_after_a_timeout_gets_the_first_answer(
    gateway: GatewayProcess, vendor: DemoUpstream, http: httpx.Client
) -> None:
    """Square's SDK retries answers, never a timeout: the application does."""
    client = square.Square(
        token="EAAA-recipes", base_url=gateway.url + "/square", httpx_client=http
    )
    marker, key = uuid.uuid4().hex, new_key()
    payment: dict[str, Any] = {"source_id": "cnon:card-nonce-ok", "note": f"{marker} {SLOW}",
                               "amount_money": {"amount": 100, "currency": "USD"},
                               "idempotency_key": key}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        client.payments.create(**payment, request_options={"timeout_in_seconds": TIMEOUT})
    again = client.payments.with_raw_response.create(**payment)
    [action] = vendor.performed(marker)
    assert again.data.payment is not None and again.data.payment.id == action["id"]
    assert again.headers["idempotent-replayed"] == "true"
