"""An external agent trained through the proxy (rollout.agent_mode=proxy), over plain OpenAI HTTP.

    python tools/arith_agent.py --run-dir RUN_DIR --data tiny/arith_train.jsonl
    python tools/arith_agent.py --proxy http://HOST:PORT --api-key "$(cat RUN_DIR/secret)" ...

It plays the tiny "a+b=" game of `env=arith_feedback` from outside the run: for every row of the
data it opens a group of --n sessions (rollout.n_samples_per_prompt), each one a conversation
with the policy through `{proxy}/s/{group}/{session}/v1/chat/completions`; a wrong answer gets
"+" (higher), "-" (lower) or "*" (not a number) back and another try; the session ends with
reward discount ** (try - 1) for a right answer (0 otherwise) posted to
`{proxy}/s/{group}/{session}/reward` (--number-bonus for a wrong number instead). It stops when the run ends (the proxy goes away) or after
--max-groups groups. --record FILE appends one JSON line per session (what it sent and got).

--run-dir reads the proxy's address (`proxy_url` in RUN_DIR/plan.json) and the API key (the
run's secret, RUN_DIR/secret) from the run directory; the key goes in every request as
`Authorization: Bearer KEY`. Any OpenAI client works the same way:
`OpenAI(base_url=f"{proxy}/s/{group}/{session}/v1", api_key=KEY)`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

RETRY_S = 0.5
RETRY_CODES = (502, 503)


class RunEnded(Exception):
    """The proxy is gone: the run finished (or failed); the agent stops."""


def post(client: httpx.Client, url: str, body: dict, timeout_s: float) -> dict:
    """POST, retrying (as OpenAI's clients do) while the proxy answers 503 (no admission credit
    yet: the trainer is behind; or the run is ending) or 502 (the engine failed: one restarted
    in place, or stopped with the run before the proxy knew); RunEnded when the proxy does not
    answer any more. A retry is safe: a request answered 502, or 503 for want of a credit,
    changed nothing, and once the run is ending every request is answered 503 until the proxy
    is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = client.post(url, json=body)
        except httpx.TransportError as e:
            raise RunEnded(str(e)) from e
        if r.status_code not in RETRY_CODES:
            break
        if time.monotonic() > deadline:
            if r.status_code == 503:
                raise RunEnded(f"{url}: still 503 after {timeout_s}s: {r.text}")
            break
        time.sleep(RETRY_S)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text}")
    return r.json()


def feedback(answer: str, label: str) -> str:
    """"+": the answer is higher, "-": lower, "*": not a number (as env=arith_feedback)."""
    value = as_number(answer)
    if value is None:
        return "*"
    return "+" if value < int(label) else "-"


def as_number(text: str) -> int | None:
    try:
        return int(text.strip())
    except ValueError:
        return None


def play(client: httpx.Client, base: str, prompt: str, label: str, max_tries: int,
         discount: float, number_bonus: float, timeout_s: float) -> dict:
    """One session: up to max_tries answers with feedback, then the reward."""
    messages = [{"role": "user", "content": prompt}]
    replies, observations, reward = [], [], 0.0
    for attempt in range(max_tries):
        body = post(client, f"{base}/v1/chat/completions",
                    {"model": "policy", "messages": messages, "max_tokens": 3}, timeout_s)
        reply = body["choices"][0]["message"]["content"]
        replies.append(reply)
        if as_number(reply) == int(label):
            reward = discount ** attempt
            break
        if as_number(reply) is not None:  # partial credit for at least answering a number
            reward = number_bonus
        if attempt + 1 < max_tries:
            observations.append(feedback(reply, label))
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": observations[-1]}]
    post(client, f"{base}/reward", {"reward": reward}, timeout_s)
    return {"prompt": prompt, "replies": replies, "observations": observations,
            "reward": reward}


def wait_ready(proxy: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{proxy}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(RETRY_S)
    raise RunEnded(f"{proxy}/health did not answer within {timeout_s}s")


def address(args: argparse.Namespace) -> tuple[str, str | None]:
    """(proxy URL, API key) from --proxy/--api-key or from --run-dir, whose plan.json the
    launcher writes when the run starts (waited for up to --timeout-s)."""
    if args.proxy:
        return args.proxy.rstrip("/"), args.api_key
    plan, deadline = args.run_dir / "plan.json", time.monotonic() + args.timeout_s
    while not plan.is_file():
        if time.monotonic() > deadline:
            raise RunEnded(f"{plan} did not appear within {args.timeout_s}s")
        time.sleep(RETRY_S)
    url = json.loads(plan.read_text()).get("proxy_url")
    if not url:
        raise SystemExit(f"{plan} has no proxy_url: start the run with rollout.agent_mode=proxy")
    wait_ready(url, args.timeout_s)  # the launcher writes the secret before starting roles
    secret = args.run_dir / "secret"
    return url.rstrip("/"), secret.read_text().strip() if secret.is_file() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--run-dir", type=Path, help="the run: proxy_url and secret from there")
    where.add_argument("--proxy", help="the run's proxy_url (RUN_DIR/plan.json)")
    p.add_argument("--api-key", help="with --proxy: the run's secret (RUN_DIR/secret)")
    p.add_argument("--data", required=True, type=Path, help="jsonl rows {prompt, label}")
    p.add_argument("--n", type=int, default=4, help="sessions per group "
                   "(the run's rollout.n_samples_per_prompt)")
    p.add_argument("--max-tries", type=int, default=2)
    p.add_argument("--discount", type=float, default=0.5)
    p.add_argument("--number-bonus", type=float, default=0.0,
                   help="reward of a session whose last answer is a number, but wrong")
    p.add_argument("--max-groups", type=int, default=0, help="0: until the run ends")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="per request, retries of 503 included; also the wait for /health")
    p.add_argument("--record", type=Path, help="append one JSON line per session here")
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    try:
        proxy, key = address(args)
        wait_ready(proxy, args.timeout_s)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(timeout=args.timeout_s, headers=headers) as client, \
                ThreadPoolExecutor(args.n) as pool:
            for k in itertools.count():
                if args.max_groups and k >= args.max_groups:
                    break
                row = rows[k % len(rows)]
                group = f"g{k}"  # a group name is used once
                sessions = list(pool.map(lambda i: play(
                    client, f"{proxy}/s/{group}/{i}", row["prompt"], str(row["label"]),
                    args.max_tries, args.discount, args.number_bonus, args.timeout_s),
                    range(args.n)))
                if args.record:
                    with args.record.open("a") as f:
                        for i, s in enumerate(sessions):
                            f.write(json.dumps({"group": group, "session": str(i), **s}) + "\n")
    except RunEnded as e:
        print(f"arith_agent: the run ended ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
