"""Adversarial probes of the shell policy (`webapp/agent/shell.py`): commands a prompt-injected model
would propose, each under the allow rules the approval dialog itself offers (so a user could have
accepted them). Every probe must ask: `check_command(probe, rules).allowed is False`.

What is covered: the classes of issue 13 (comments after process substitution, brace expansion,
`$BASH_…` variables, subscripts evaluated by builtins, options that run programs or write files,
interpreters), and the grammar's refusals (redirections, here-docs, quoting, globs, assignments,
control flow, invisible characters, oversized and deeply nested input, programs by path). Positive
controls prove the policy still allows the plain commands it exists for.
What is not covered: what the commands would do when run — `test_sandbox_e2e.py` runs them.
A probe's payload writes `/tmp/pwned`; nothing here runs anything.
"""

from __future__ import annotations

import time

import pytest

from webapp.agent.shell import Rule, check_command, validate_rule

M = "/tmp/pwned"


def rules(*specs: str) -> tuple[Rule, ...]:
    """`"ls"` is a prefix rule, `"=ls -la"` an exact rule."""
    return tuple(Rule("exact", s[1:]) if s.startswith("=") else Rule("prefix", s) for s in specs)


# Every prefix the dialog could plausibly have offered for an ordinary command and the user accepted.
OFFERED = rules(
    "ls", "cat", "echo", "grep", "find", "git status", "git log", "git diff", "git grep", "git show",
    "git shortlog", "git blame", "sort", "head", "tail", "wc", "printf", "tree", "file", "date", "rg",
    "du", "stat", "diff", "uniq",
)  # fmt: skip

PROBES: list = []


def probe_class(name: str, default_rules: tuple[Rule, ...], cases: list[tuple]) -> list:
    """Register probes: each case is (id, command) or (id, command, rules)."""
    out = []
    for case in cases:
        pid, command, *extra = case
        out.append(pytest.param(command, extra[0] if extra else default_rules, id=f"{name}-{pid}"))
    PROBES.extend(out)
    return out


COMMENTS = probe_class(
    "comment",
    rules("ls", "cat", "echo"),
    [
        ("procsub-hash", f"ls <(ls)#; touch {M}"),
        ("procsub-hash-nospace", f"ls <(ls)#;touch {M}"),
        ("outsub-hash", f"ls >(cat)#; touch {M}"),
        ("procsub-hash-and", f"cat <(echo x)#&& touch {M}"),
        ("procsub-space-hash", f"ls <(ls) #; touch {M}"),
        ("cmdsub-hash", f"ls $(ls)#; touch {M}"),
        ("word-hash", f"ls# ; touch {M}"),
        ("midword-hash", f"echo a#b; touch {M}"),
        ("plain-comment", "ls # just a comment"),
        ("comment-newline", f"ls #\ntouch {M}"),
        ("procsub-payload", f"ls <(touch {M})"),
        ("procsub-cat", f"cat <(touch {M})"),
        ("outsub-payload", f"ls >(touch {M})"),
        ("procsub-echo", "echo <(ls)"),
        ("quoted-cmdsub-hash", f'ls "$(touch {M})"#'),
    ],
)

BRACES = probe_class(
    "brace",
    rules("find", "echo", "ls", "sort", "git log"),
    [
        ("find-exec-dq", f'find . {{-exec,touch,{M},";"}}'),
        ("find-exec-escaped", f"find . {{-exec,touch,{M},\\;}}"),
        ("find-exec-sq", f"find . {{'-exec',touch,{M},';'}}"),
        ("find-exec-dq-opt", f'find . {{"-exec",touch,{M},";"}}'),
        ("find-delete", "find . -name x -o {-delete,-true}"),
        ("find-fprint", f"find . {{-fprint,{M}}}"),
        ("find-all", f"find {{.,-fprint,{M}}}"),
        ("find-infix", f"find . -e{{x,}}ec touch {M} ';'"),
        ("sort-o", f"sort {{-o,{M}}} README.md"),
        ("sort-uo", f"sort -u{{o,}} {M} README.md"),
        ("git-log-output", f"git log {{--output={M},-1}}"),
        ("command-name", "{ls,-la}"),
        ("echo-list", "echo {a,b}"),
        ("echo-seq", "echo {1..3}"),
        ("ls-root", "ls {.,/}"),
        ("echo-empty-alt", "echo a{,}"),
        ("echo-product", "echo {a,b}{c,d}"),
    ],
)

SPECIAL_VARS = probe_class(
    "var",
    rules("echo", "ls", "find", "cat", "printf"),
    [
        ("bash-command", "echo $BASH_COMMAND"),
        ("bash-command-find", "find . $BASH_COMMAND"),
        ("bash-command-braced", "ls ${BASH_COMMAND}"),
        ("bash-command-subst", f"echo ${{BASH_COMMAND/echo/touch {M}}}"),
        ("bash-exec-string", f"find . -maxdepth 0 ${{BASH_EXECUTION_STRING##*#}} #-exec touch {M} ;"),
        ("bash-binary", f"$BASH -c 'touch {M}'"),
        ("bash-argv0", "echo $BASH_ARGV0"),
        ("bash-source", "echo $BASH_SOURCE"),
        ("indirect-prefix", "echo ${!BASH*}"),
        ("indirect-path", "echo ${!PATH*}"),
        ("indirect", "echo ${!x}"),
        ("indirect-positional", "ls ${!1}"),
        ("last-arg", "echo $_"),
        ("last-arg-ls", "ls $_"),
        ("last-arg-command", "$_"),
        ("dollar-zero", "echo $0"),
        ("pid", "echo $$"),
        ("random", "echo $RANDOM"),
        ("all-args", "echo $@"),
        ("positional", "echo $1"),
        ("count", "echo $#"),
        ("home-dq", 'echo "$HOME"'),
        ("path-braced-dq", 'echo "${PATH}"'),
        ("home", "echo $HOME"),
        ("home-secret", "cat $HOME/.ssh/id_rsa"),
        ("prompt-expand", "echo ${x@P}"),
        ("default-subst", f"echo ${{x:-$(touch {M})}}"),
        ("ps4-prompt", "echo ${PS4@P}"),
        ("printf-var", 'printf "%s" "$OPENAI_API_KEY"'),
    ],
)

SUBSCRIPTS = probe_class(
    "subscript",
    rules("printf", "test", "echo", "read", "declare", "let", "unset", "export", "mapfile", "[", "wait"),
    [
        ("printf-v", f"printf -v 'a[$(touch {M})]' x"),
        ("printf-v-bundled", f"printf -va'[$(touch {M})]' x"),
        ("printf-v-concat", f"printf -v a'[$(touch {M})]' x"),
        ("printf-v-dq-escaped", f'printf -v "a[\\$(touch {M})]" x'),
        ("test-v", f"test -v 'a[$(touch {M})]'"),
        ("test-v-concat", f"test -v a'[$(touch {M})]'"),
        ("bracket-v", f"[ -v 'a[$(touch {M})]' ]"),
        ("dbracket-v", f"[[ -v a[$(touch {M})] ]]"),
        ("dbracket-eq", f"[[ 'a[$(touch {M})]' -eq 1 ]]"),
        ("test-eq", f"test 'a[$(touch {M})]' -eq 1"),
        ("let", f"let 'a[$(touch {M})]=1'"),
        ("let-plain", "let x=1"),
        ("declare", f"declare 'a[$(touch {M})]=1'"),
        ("declare-a", f"declare -a 'a[$(touch {M})]=1'"),
        ("typeset", f"typeset 'a[$(touch {M})]=1'"),
        ("local", f"local 'a[$(touch {M})]=1'"),
        ("readonly", f"readonly 'a[$(touch {M})]=1'"),
        ("export", f"export 'a[$(touch {M})]=1'"),
        ("read-herestring", f"read 'a[$(touch {M})]' <<< x"),
        ("read-a", f"read -a 'a[$(touch {M})]'"),
        ("read", f"read 'a[$(touch {M})]'"),
        ("mapfile", f"mapfile -t 'a[$(touch {M})]'"),
        ("unset", f"unset 'a[$(touch {M})]'"),
        ("arith-command", f"(( a[$(touch {M})] ))"),
        ("arith-expansion", f"echo $(( a[$(touch {M})] ))"),
        ("arith-plain", "echo $((1+2))"),
        ("arith-old", "echo $[1+1]"),
        ("wait-p", f"wait -p 'a[$(touch {M})]'"),
        ("getopts", f"getopts a 'b[$(touch {M})]'"),
    ],
)

FIND = rules("find")
TAR = rules("tar")
GIT = rules("git status", "git log", "git diff", "git grep", "git show", "git shortlog", "git blame")
OPTIONS = probe_class(
    "option",
    OFFERED,
    [
        ("find-fprint", f"find . -fprint {M}", FIND),
        ("find-fprint0", f"find . -fprint0 {M}", FIND),
        ("find-fprintf", f"find . -fprintf {M} %p", FIND),
        ("find-fls", f"find . -fls {M}", FIND),
        ("find-exec", f"find . -exec touch {M} ';'", FIND),
        ("find-exec-plus", f"find . -exec touch {M} {{}} +", FIND),
        ("find-execdir", f"find . -execdir touch {M} ';'", FIND),
        ("find-ok", f"find . -ok touch {M} ';'", FIND),
        ("find-okdir", f"find . -okdir touch {M} ';'", FIND),
        ("find-delete", "find . -delete", FIND),
        ("find-name-delete", "find . -name '*.py' -delete", FIND),
        ("find-dashdash-exec", f"find -- . -maxdepth 0 -exec touch {M} ';'", FIND),
        ("find-dashdash-fprint", f"find -L -- . -fprint {M}", FIND),
        ("find-dashdash-delete", "find -- . -delete", FIND),
        (
            "tar-checkpoint-action",
            f"tar -cf /dev/null --checkpoint=1 '--checkpoint-action=exec=touch {M}' .",
            TAR,
        ),
        ("tar-checkpoint-a", f"tar -cf /dev/null --checkpoint=1 --checkpoint-a='exec=touch {M}' .", TAR),
        ("tar-checkpoint-act", "tar -cf /dev/null --checkpoint=1 --checkpoint-act=exec=id .", TAR),
        ("tar-bundled-I", f"tar -cI'touch {M};cat' -f x.tar .", TAR),
        ("tar-compress-program", f"tar --use-compress-program='touch {M}' -cf x.tar .", TAR),
        ("tar-compress-p", f"tar --use-compress-p='touch {M}' -cf x.tar .", TAR),
        ("tar-to-command", f"tar -xf x.tar --to-command='touch {M}'", TAR),
        ("tar-rsh-command", "tar --rsh-command=/tmp/evil -cf host:x .", TAR),
        ("tar-rsh-c", "tar --rsh-c=/tmp/evil -cf host:x .", TAR),
        ("tar-F", "tar -F /tmp/evil -cf x.tar .", TAR),
        ("tar-info-script", "tar --info-script=/tmp/evil -cf x.tar .", TAR),
        ("tar-new-volume-script", "tar --new-volume-script=/tmp/evil -cf x.tar .", TAR),
        ("tar-write-outside", f"tar -cf {M} .", TAR),
        ("tar-extract-outside", "tar -xf x.tar -C /tmp", TAR),
        ("git-grep-open-files", f"git grep --open-files-in-pager='touch {M}' x", GIT),
        ("git-grep-open", f"git grep --open='touch {M}' x", GIT),
        ("git-grep-O", f"git grep -O'touch {M}' x", GIT),
        ("git-grep-nO", f"git grep -nO'touch {M}' x", GIT),
        ("git-grep-O-default", "git grep -O x", GIT),
        ("git-log-output", f"git log --output={M}", GIT),
        ("git-log-outp", f"git log --outp={M}", GIT),
        ("git-log-output-sep", f"git log --output {M}", GIT),
        ("git-log-ext-diff", "git log -p --ext-diff", GIT),
        ("git-log-textconv", "git log -p --textconv", GIT),
        ("git-diff-ext-diff", "git diff --ext-diff", GIT),
        ("git-diff-ext", "git diff --ext", GIT),
        ("git-diff-output", f"git diff --output={M}", GIT),
        ("git-diff-ou", f"git diff --ou={M}", GIT),
        ("git-show-output", f"git show --output={M}", GIT),
        ("git-shortlog-output", f"git shortlog --output={M} HEAD", GIT),
        ("git-c-pager", f"git -c core.pager='touch {M}' log", GIT),
        ("git-c-fsmonitor", f"git -c core.fsmonitor='touch {M}' status", GIT),
        ("git-config-env", "git --config-env=core.pager=X log", GIT),
        ("git-exec-path", "git --exec-path=/tmp status", GIT),
        ("git-C", "git -C /tmp/evil status", GIT),
        ("git-git-dir", "git --git-dir=/tmp/evil/.git status", GIT),
        ("git-paginate", "git -p log", GIT),
        ("git-submodule-foreach", f"git submodule foreach 'touch {M}'", GIT),
        ("git-config-write", f"git config core.pager 'touch {M}'", GIT),
        ("vim-cmd", f"vim --cmd '!touch {M}'", rules("vim")),
        ("vim-c", f"vim -c '!touch {M}'", rules("vim")),
        ("vim-plus", f"vim +'!touch {M}'", rules("vim")),
        ("vim-S", "vim -es -S /tmp/evil.vim", rules("vim")),
        ("make-eval", f"make --eval='$(shell touch {M})'", rules("make")),
        ("make-ev", f"make --ev='$(shell touch {M})'", rules("make")),
        ("make-E", "make -E 'x:=1'", rules("make")),
        ("make-f", "make -f /tmp/evil.mk", rules("make")),
        ("man-html", f"man --html='touch {M}' ls", rules("man")),
        ("man-H-bundled", f"man -H'touch {M}' ls", rules("man")),
        ("man-htm", "man --htm=x ls", rules("man")),
        ("man-P", f"man -P 'touch {M}' ls", rules("man")),
        ("man-pager", f"man --pager='touch {M}' ls", rules("man")),
        ("man-aHx", "man -aHx ls", rules("man")),
        ("rsync-e", f"rsync -e 'touch {M}' a host:b", rules("rsync")),
        ("rsync-e-bundled", f"rsync -ave'touch {M}' a host:b", rules("rsync")),
        ("rsync-rsh", f"rsync --rsh='touch {M}' a host:b", rules("rsync")),
        ("rsync-rsync-path", f"rsync --rsync-path='touch {M}' a host:b", rules("rsync")),
        ("rsync-copy-out", f"rsync -a . {M}", rules("rsync")),
        (
            "docker-container-run",
            f"docker container run --rm -v /:/h alpine touch /h{M}",
            rules("docker", "docker container", "docker ps"),
        ),
        ("docker-run", "docker run --rm alpine true", rules("docker", "docker container", "docker ps")),
        ("docker-container-exec", "docker container exec box sh", rules("docker", "docker container")),
        ("docker-compose-run", "docker compose run web sh", rules("docker", "docker compose")),
        ("npm-x", f"npm x -- touch {M}", rules("npm", "npm x")),
        ("npm-exec", f"npm exec -- touch {M}", rules("npm", "npm exec")),
        ("npm-run", "npm run evil", rules("npm", "npm run")),
        ("npm-rum", "npm rum evil", rules("npm")),
        ("npm-test", "npm test", rules("npm")),
        ("npm-install", "npm install", rules("npm")),
        ("npx", f"npx touch {M}", rules("npx", "npm")),
        ("sort-o", f"sort -o {M} README.md", rules("sort")),
        ("sort-o-attached", f"sort -o{M} README.md", rules("sort")),
        ("sort-output", f"sort --output={M} README.md", rules("sort")),
        ("sort-o-abbrev", f"sort --o={M} README.md", rules("sort")),
        ("sort-outp-sep", f"sort --outp {M} README.md", rules("sort")),
        ("sort-uo", f"sort -uo {M} README.md", rules("sort")),
        ("sort-uo-attached", f"sort -uo{M} README.md", rules("sort")),
        ("sort-compress-program", f"sort --compress-program='touch {M}' -S 1 README.md", rules("sort")),
        ("sort-compress-p", "sort --compress-p=x README.md", rules("sort")),
        ("sort-T", "sort -T /tmp README.md", rules("sort")),
        ("tree-o", f"tree -o {M}", rules("tree")),
        ("tree-o-attached", f"tree -o{M}", rules("tree")),
        ("tree-ao", f"tree -ao {M}", rules("tree")),
        ("tree-R-system", "tree -R -H . -L 1", rules("tree")),
        ("tree-RH-bundled", "tree -RH . -L 1", rules("tree")),
        ("file-C", "file -C -m README.md", rules("file")),
        ("file-compile", "file --compile -m README.md", rules("file")),
        ("file-comp", "file --comp -m README.md", rules("file")),
        ("file-z", "file -z x.gz", rules("file")),
        ("date-s", "date -s 2020-01-01", rules("date")),
        ("date-set", "date --set=2020-01-01", rules("date")),
        ("date-se", "date --se=2020-01-01", rules("date")),
        ("date-us", "date -us @0", rules("date")),
        ("date-operand-sets-clock", "date 010100002020", rules("date")),
        ("date-u-operand", "date -u 0101000020", rules("date")),
        ("rg-pre", f"rg --pre='touch {M}' x", rules("rg")),
        ("rg-pre-sep", "rg --pre touch x", rules("rg")),
        ("rg-pre-glob", "rg --pre-glob '*' --pre touch x", rules("rg")),
        ("rg-z", "rg -z x", rules("rg")),
        ("rg-search-zip", "rg --search-zip x", rules("rg")),
        ("rg-hostname-bin", "rg --hostname-bin=/tmp/evil x", rules("rg")),
        ("uniq-outfile", f"uniq README.md {M}", rules("uniq")),
        ("xxd-outfile", f"xxd README.md {M}", rules("xxd")),
        ("tee", f"echo x | tee {M}", rules("echo", "tee")),
        ("cp", f"cp README.md {M}", rules("cp")),
        ("dd", f"dd if=README.md of={M}", rules("dd")),
        ("curl-o", f"curl -o {M} http://127.0.0.1/", rules("curl")),
        ("curl-Lo", f"curl -Lo{M} http://127.0.0.1/", rules("curl")),
        ("wget-O", f"wget -O {M} http://127.0.0.1/", rules("wget")),
        ("sed-i", "sed -i s/a/b/ README.md", rules("sed")),
        ("fd-x", f"fd -x touch {M}", rules("fd")),
        ("fd-exec-batch", f"fd --exec-batch touch {M}", rules("fd")),
        ("less-bang", f"less +'!touch {M}' README.md", rules("less")),
        ("zip-TT", f"zip -TT='touch {M}' x.zip README.md", rules("zip")),
    ],
)

# `--` after an option that takes the next word as its value is that value, not the end of the options:
# the denied option after it still runs (red-team: rg ran `sh notes.sh`, git grep ran a file as a pager, sort
# ran its temporary data as a shell script, tree and sort wrote files, all under plain prefix rules)
DASHDASH_VALUE = probe_class(
    "dashdash-value",
    (),
    [
        ("rg-e", "rg -e -- --pre=sh x notes.sh", rules("rg")),
        ("rg-regexp", "rg --regexp -- --pre=sh x notes.sh", rules("rg")),
        ("rg-e-search-zip", "rg -e -- -z x a.gz", rules("rg")),
        ("git-grep-e", "git grep -e -- -Osh -- notes.sh", rules("git grep")),
        ("git-log-output", f"git log --author -- --output={M}", rules("git log")),
        ("sort-compress", "sort --random-source -- --compress-program=sh -S 4k big.txt", rules("sort")),
        ("sort-o", f"sort --random-source -- -o {M} in.txt", rules("sort")),
        ("tree-o", f"tree -P -- -o {M} .", rules("tree")),
        ("file-C", "file -F -- -C -m mymagic", rules("file")),
        ("date-set", "date -d -- --set=1999-01-01", rules("date")),
        ("date-value-rearmed", "date -d -d 0101000099", rules("date")),  # a value re-arming the next (review)
        ("date-value-rearmed-r", "date -r -f 0101000099", rules("date")),
    ],
)

INTERPRETERS = [
    "python3.13t", "python3.12", "python3", "python", "pypy3", "toybox", "busybox", "ipython", "ipython3",
    "Rscript", "R", "julia", "irb", "ruby", "valgrind", "xvfb-run", "prlimit", "fakeroot", "tmux",
    "screen", "xcrun", "env", "xargs", "nice", "ionice", "timeout", "stdbuf", "script", "expect", "gdb",
    "lldb", "perl", "perl5.36", "awk", "gawk", "mawk", "sed", "node", "nodejs", "deno", "bun", "php",
    "lua", "luajit", "tclsh", "guile", "sbcl", "ghci", "swift", "osascript", "nohup", "setsid",
    "taskset", "chrt", "flock", "sudo", "su", "doas", "pkexec", "systemd-run", "nsenter", "unshare",
    "chroot", "strace", "ltrace", "watch", "parallel", "sh", "bash", "dash", "zsh", "fish", "ksh",
    "eval", "exec", "source", ".", "command", "builtin", "npx", "uvx", "pipx", "make", "cmake", "docker",
    "npm", "tar", "rsync", "vim", "nvim", "emacs", "ed", "less", "more", "man", "ssh", "curl", "wget",
    "cp", "mv", "tee", "dd", "git", "jobs", "trap", "alias", "enable", "hash",
]  # fmt: skip
INTERPRETER_PROBES = probe_class(
    "interpreter",
    (),
    [(prog, f"{prog} -c 'touch {M}'", rules(prog)) for prog in INTERPRETERS],
)

REDIRECTS = probe_class(
    "redirect",
    rules("ls", "echo", "cat"),
    [
        ("gt", f"echo x > {M}"),
        ("append", f"echo x >> {M}"),
        ("clobber", f"echo x >| {M}"),
        ("and-gt", f"ls &> {M}"),
        ("and-append", f"ls &>> {M}"),
        ("stderr", f"ls 2> {M}"),
        ("stderr-append", f"ls 2>> {M}"),
        ("named-fd", f"ls {{fd}}>{M}"),
        ("read-write", f"ls <>{M}"),
        ("read-write-fd", f"ls 1<>{M}"),
        ("gt-and-file", f"ls >&{M}"),
        ("fd3", f"ls 3>{M}"),
        ("null-then-file", f"ls 2>/dev/null >{M}"),
        ("file-then-dup", f"ls >{M} 2>&1"),
        ("in-project", "ls > out.txt"),
        ("dev-null-dotdot", "ls >/dev/null/../../tmp/pwned"),
        ("dev-nul", "ls >/dev/nul"),
        ("dev-null-suffix", "ls >/dev/null2"),
        ("dev-tcp", "ls > /dev/tcp/127.0.0.1/80"),
        ("read-secret", "cat < /etc/shadow"),
        ("read-secret-fd0", "cat 0</etc/shadow"),
        ("dup-then-file", f"ls 2>&1 >{M}"),
        ("fd0-out", f"ls 0>{M}"),
        ("fd9-append", f"ls 9>>{M}"),
        ("dq-target", f'echo x >"{M}"'),
        ("sq-target", f"echo x >'{M}'"),
        ("var-target", "ls >$HOME/x"),
        ("tilde-target", "ls > ~/.bashrc"),
        ("and-null-then-file", f"ls &>/dev/null >{M}"),
        ("dup-stderr-file", f"ls 1>&2 2>{M}"),
        ("bare", f"> {M}"),
        ("before-command", f">{M} ls"),
        ("twice", f"ls 2>/dev/null 2>{M}"),
        ("dup-input", "cat <&0"),
    ],
)

HEREDOCS = probe_class(
    "heredoc",
    rules("cat", "echo", "grep"),
    [
        ("cmdsub-body", f"cat <<EOF\n$(touch {M})\nEOF"),
        ("quoted-delim", "cat <<'EOF'\nx\nEOF"),
        ("dash", "cat <<-EOF\n\tx\n\tEOF"),
        ("herestring-cmdsub", f'cat <<< "$(touch {M})"'),
        ("herestring", "cat <<< x"),
        ("herestring-grep", "grep x <<< 'a'"),
        ("body-redirect", f"cat <<EOF > {M}\nx\nEOF"),
        ("delim-then-command", f"cat <<EOF; touch {M}\nx\nEOF"),
        ("empty-body-then-command", f"cat << EOF\nEOF\ntouch {M}"),
        ("backtick-body", f"cat <<EOF\n`touch {M}`\nEOF"),
    ],
)

ANSI_C = probe_class(
    "quoting",
    rules("echo", "ls"),
    [
        ("ansi-c", "echo $'\\x41'"),
        ("ansi-c-command", f"$'\\x74ouch' {M}"),
        ("ansi-c-option", "ls $'-la'"),
        ("ansi-c-name", "$'ls'"),
        ("locale", 'echo $"hello"'),
        ("ansi-c-semicolon", f"ls $'\\x3b' touch {M}"),
        ("locale-cmdsub", f'echo $"$(touch {M})"'),
        ("backslash-escape", "echo a\\;b"),
        ("line-continuation", "ls \\\n-la"),
        ("backtick", f"echo `touch {M}`"),
        ("cmdsub", f"echo $(touch {M})"),
        ("dq-cmdsub", f'echo "$(touch {M})"'),
        ("dq-backtick", f'echo "`touch {M}`"'),
        ("dq-backslash", 'echo "a\\"b"'),
        ("dq-history", 'echo "!!"'),
        ("unclosed-sq", "ls 'unclosed"),
        ("unclosed-dq", 'ls "unclosed'),
    ],
)

GLOBS = probe_class(
    "glob",
    rules("ls", "cat", "find", "echo", "grep"),
    [
        ("star", "ls *"),
        ("question", "ls ?"),
        ("class", "ls [a]*"),
        ("tilde-ssh", "cat ~/.ssh/id_rsa"),
        ("tilde-user", "cat ~root/.ssh/id_rsa"),
        ("tilde-plus", "ls ~+"),
        ("tilde-minus", "ls ~-"),
        ("find-unquoted", "find . -name *.py"),
        ("globstar", "ls **"),
        ("extglob-not", "ls !(x)"),
        ("extglob-at", "ls @(a|b)"),
        ("path-question", "cat /etc/pass?d"),
        ("grep-home", "grep -r x ~"),
        ("tilde-after-equals", "echo a=~/x"),
        ("dash-star", "ls ./-*"),
        ("glob-command", "/bin/l? -la"),
    ],
)

ASSIGNMENTS = probe_class(
    "assign",
    rules("ls", "git log", "git diff", "less", "echo"),
    [
        ("path-dot", "PATH=. ls"),
        ("path-tmp", "PATH=/tmp ls"),
        ("bash-env", "BASH_ENV=./evil ls"),
        ("ld-preload", "LD_PRELOAD=./x.so ls"),
        ("git-pager", f"GIT_PAGER='touch {M}' git log"),
        ("git-external-diff", f"GIT_EXTERNAL_DIFF='touch {M}' git diff"),
        (
            "git-config-env",
            f"GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=core.pager GIT_CONFIG_VALUE_0='touch {M}' git log",
        ),
        ("bare", "x=1"),
        ("subscript", f"a[$(touch {M})]=1"),
        ("ifs", "IFS=/ ls"),
        ("export-then", "export PATH=.; ls"),
        ("lessopen", f"LESSOPEN='|touch {M} %s' less README.md"),
        ("git-ssh-command", f"GIT_SSH_COMMAND='touch {M}' git log"),
        ("prompt-command", f"PROMPT_COMMAND='touch {M}' ls"),
        ("harmless-var", "x=1 ls"),
        ("second-part", "ls; PATH=. ls"),
        ("env-wrapper", "env PATH=. ls"),
        ("append-assign", "PATH+=:. ls"),
    ],
)

CONTROL = probe_class(
    "control",
    rules("ls", "echo", "cat", "true"),
    [
        ("if", f"if ls; then touch {M}; fi"),
        ("while", f"while ls; do touch {M}; break; done"),
        ("for", "for f in a; do ls; done"),
        ("case", f"case a in a) touch {M};; esac"),
        ("until", "until ls; do true; done"),
        ("select", "select x in a; do ls; done"),
        ("bang", "! ls"),
        ("time", "time ls"),
        ("group", "{ ls; }"),
        ("subshell", "(ls)"),
        ("subshell-payload", f"(ls; touch {M})"),
        ("and-subshell", f"ls && (touch {M})"),
        ("semicolon", f"ls; touch {M}"),
        ("and", f"ls && touch {M}"),
        ("or", f"ls || touch {M}"),
        ("pipe", f"ls | touch {M}"),
        ("newline", f"ls\ntouch {M}"),
        ("pipe-sh", "ls | sh"),
        ("dbracket", "[[ -f x ]]"),
        ("arith", "(( 1 ))"),
        ("eval", "eval ls"),
        ("exec", "exec ls"),
        ("command", "command ls"),
        ("builtin", "builtin echo x"),
        ("trap", f"trap 'touch {M}' EXIT; ls"),
        ("while-read", "ls | while read l; do echo; done"),
        ("and-eval", f"ls && eval 'touch {M}'"),
        ("function", f"f() {{ touch {M}; }}; f"),
        ("shadow-ls", f"ls() {{ touch {M}; }}; ls"),
        ("function-keyword", f"function ls {{ touch {M}; }}; ls"),
        ("function-subshell-body", "function f() ( ls )"),
        ("coproc", "coproc ls"),
        ("coproc-named", "coproc x { ls; }"),
        ("coproc-payload", f"coproc touch {M}"),
        ("background", "ls &"),
        ("background-then", f"ls & touch {M}"),
        ("background-nospace", f"ls&touch {M}"),
        ("background-ls", "ls & ls"),
        ("pipe-stderr", f"ls |& touch {M}"),
        ("double-semicolon", "ls ;;"),
        ("stray-paren", "ls )"),
        ("open-paren", "(ls"),
        ("empty", ""),
        ("blank", "   \n  "),
    ],
)

UNICODE = probe_class(
    "unicode",
    rules("ls", "echo", "cat"),
    [
        ("rlo-name", "ls\u202e -la"),
        ("rlo-arg", "ls -la \u202etxt.exe"),
        ("rlo-quoted", f"echo '\u202e; touch {M}'"),
        ("zwsp-name", "ls\u200b -la"),
        ("zwsp-arg", "ls -la\u200b"),
        ("nbsp-separator", "ls\u00a0-la"),
        ("fullwidth-semicolon", f"ls \uff1btouch {M}"),
        ("fullwidth-and", f"ls \uff06\uff06 touch {M}"),
        ("roman-l", "\u217cs -la"),
        ("cyrillic-c", "\u0441at README.md"),
        ("line-separator", f"ls\u2028touch {M}"),
        ("paragraph-separator", f"ls\u2029touch {M}"),
        ("nel", f"ls\u0085touch {M}"),
        ("bom", "\ufeffls"),
        ("soft-hyphen", "ls -la\u00ad"),
        ("isolates", "ls\u2066 -la\u2069"),
        ("mongolian-vs", "ls \u180e"),
        ("ideographic-space", "ls\u3000-la"),
        ("thin-space", "ls\u2009-la"),
        ("greek-question-mark", f"echo x\u037e touch {M}"),
        ("ansi-escape", "ls\x1b[2K"),
        ("lone-surrogate", "ls \ud800"),
    ],
)

CONTROL_CHARS = probe_class(
    "control-char",
    rules("ls", "echo"),
    [
        ("nul-then-command", f"ls\x00; touch {M}"),
        ("nul-trailing", "ls -la\x00"),
        ("nul-quoted", "echo 'a\x00b'"),
        ("cr-overwrite", f"ls\rtouch {M}"),
        ("cr-hides-option", "ls\r -la"),
        ("crlf", f"ls\r\ntouch {M}"),
        ("cr-then-command", f"echo x\r; touch {M}"),
        ("vertical-tab", "ls\x0b-la"),
        ("form-feed", "ls\x0c-la"),
        ("delete", "ls\x7f"),
        ("backspaces", f"ls\x08\x08touch {M}"),
        ("bell", "ls \x07"),
    ],
)

PATHS = probe_class(
    "path",
    rules("ls", "cat", "git status"),
    [
        ("bin-ls", "/bin/ls"),
        ("usr-bin-ls", "/usr/bin/ls -la"),
        ("dot-ls", "./ls"),
        ("dotdot-ls", "../ls"),
        ("relative", "bin/ls"),
        ("tmp-ls", "/tmp/ls"),
        ("tilde-ls", "~/ls"),
        ("escaped-name", "l\\s"),
        ("escaped-alias", "\\ls"),
        ("quoted-dot-ls", '"./ls"'),
        ("git-hook-path", ".git/hooks/ls"),
        ("env-ls", "/usr/bin/env ls"),
        ("hash-p", "hash -p ./evil ls; ls"),
        ("enable-f", "enable -f ./evil.so ls; ls"),
        ("alias", f"shopt -s expand_aliases; alias ls='touch {M}'\nls"),
        ("dot-git", "./git status"),
        ("usr-bin-git", "/usr/bin/git status"),
        ("dot-source", "source ./evil.sh"),
        ("dot-builtin", ". ./evil.sh"),
    ],
)

EXACT = probe_class(
    "exact",
    (),
    [
        ("then-command", f"ls; touch {M}", rules("=ls")),
        ("and-command", f"ls -la && touch {M}", rules("=ls -la")),
        ("not-plain-cmdsub", f"echo $(touch {M})", rules(f"=echo $(touch {M})")),
        ("not-plain-heredoc", "cat <<EOF\nx\nEOF", rules("=cat <<EOF\nx\nEOF")),
        ("not-plain-redirect", "ls > out.txt", rules("=ls > out.txt")),
        ("not-plain-make-log", "make test > log.txt", rules("=make test > log.txt")),
        ("not-plain-procsub-hash", f"ls <(ls)#; touch {M}", rules(f"=ls <(ls)#; touch {M}")),
        ("not-plain-rlo", "ls\u202e", rules("=ls\u202e")),
        ("not-plain-glob", "ls *", rules("=ls *")),
        ("comment-suffix", f"ls #; touch {M}", rules("=ls")),
        ("newline-suffix", f"git status\ntouch {M}", rules("=git status")),
        ("nul-suffix", f"ls\x00; touch {M}", rules("=ls")),
        ("not-plain-assign", "PATH=. ls", rules("=PATH=. ls")),
        ("not-plain-background", "ls &", rules("=ls &")),
        ("make-then", f"make test; touch {M}", rules("=make test")),
        ("npm-then", f"npm test && npm x touch {M}", rules("=npm test")),
        ("pipe-sh", "ls | sh", rules("=ls")),
        ("part-exact-stateful", "printf -v x y; cat x", rules("=printf -v x y", "=cat x")),
        ("part-exact-export", "export PATH=.; ls", rules("=export PATH=.", "ls")),
    ],
)


@pytest.mark.parametrize("command,rule_set", PROBES)
def test_probe_asks_under_the_rules_an_attacker_got(command: str, rule_set: tuple[Rule, ...]) -> None:
    v = check_command(command, rule_set)
    assert v.allowed is False, (command, v.reason)
    v = check_command(command, (*rule_set, *OFFERED))
    assert v.allowed is False, (command, v.reason)


@pytest.mark.parametrize("command,rule_set", PROBES)
def test_probe_dialog_offer_would_not_allow_it(command: str, rule_set: tuple[Rule, ...]) -> None:
    """Accepting the prefix the dialog offers for the probe must not make the probe auto-allowed."""
    v = check_command(command, [])
    assert v.allowed is False
    if v.prefix is not None:
        validate_rule("prefix", v.prefix)  # the dialog never offers a rule the store would refuse
        again = check_command(command, [Rule("prefix", v.prefix)])
        assert again.allowed is False, (command, v.prefix, again.reason)


@pytest.mark.parametrize("program", INTERPRETERS)
def test_programs_that_run_code_are_never_prefix_allowable(program: str) -> None:
    with pytest.raises(ValueError):
        validate_rule("prefix", program)
    v = check_command(f"{program} -c 'touch {M}'", [])
    assert v.prefix is None or v.prefix.split()[0] != program, v.prefix


@pytest.mark.parametrize(
    "pattern",
    [
        "ls; rm -rf ~", "ls && touch x", "ls | sh", "ls $(x)", "ls > x", "ls 2>/dev/null", "PATH=. ls",
        "find . -exec touch x ';'", "find -- . -exec touch x ';'", "git -c x=y log", "sort -o x", "git",
        "", "   ", "ls #", "ls &", "{ls,-la}", "ls\u202e", "date 010100002020", "git shortlog --output=x",
        "tree -R", "/bin/ls", "./ls", "~/ls",
    ],
)  # fmt: skip
def test_validate_rule_refuses_prefix_rules_that_must_never_exist(pattern: str) -> None:
    with pytest.raises(ValueError):
        validate_rule("prefix", pattern)


@pytest.mark.parametrize("pattern", ["ls", "cat", "grep", "find", "git status", "git log", "git diff", "sort",
                                     "head", "wc", "echo", "grep -rn"])  # fmt: skip
def test_validate_rule_accepts_the_prefixes_the_dialog_offers(pattern: str) -> None:
    assert validate_rule("prefix", pattern).pattern == pattern


POSITIVE = [
    pytest.param("ls -la src", rules("ls"), id="ls"),
    pytest.param("git status --short", rules("git status"), id="git-status"),
    pytest.param("grep -rn 'foo bar' src", rules("grep"), id="grep-quoted"),
    pytest.param("ls | wc -l", rules("ls", "wc"), id="pipe"),
    pytest.param("git status && git diff", rules("git status", "git diff"), id="and-list"),
    pytest.param("ls 2>/dev/null", rules("ls"), id="stderr-null"),
    pytest.param("find . -name '*.py'", rules("find"), id="find-quoted-glob"),
    pytest.param("cat README.md", rules("cat"), id="cat"),
    pytest.param('echo "hello world"', rules("echo"), id="echo-dq"),
    pytest.param("head -n 20 README.md", rules("head"), id="head"),
    pytest.param("git log --oneline -n 5", rules("git log"), id="git-log"),
    pytest.param("git diff --stat", rules("git diff"), id="git-diff"),
    pytest.param("sort -u names.txt", rules("sort"), id="sort"),
    pytest.param("wc -l README.md", rules("wc"), id="wc"),
    pytest.param("printf '%s %s' a b", rules("printf"), id="printf"),
    pytest.param("ls -la 2>&1 | head -n 5", rules("ls", "head"), id="dup-pipe"),
    pytest.param("grep -c foo README.md; wc -l README.md", rules("grep", "wc"), id="semicolon-list"),
    pytest.param("ls -la && echo done", rules("ls", "echo"), id="and-echo"),
    pytest.param("cat -n src/main.py | grep -n def", rules("cat", "grep"), id="cat-grep"),
    pytest.param("git log --oneline | head -n 3", rules("git log", "head"), id="git-log-head"),
    pytest.param("echo 'a;b|c&d'", rules("echo"), id="metachars-in-sq"),
    pytest.param("grep -n 'def main$' src/app.py", rules("grep"), id="dollar-in-sq"),
    pytest.param("git status; git log -n 1", rules("git status", "git log"), id="git-semicolon"),
    pytest.param("ls -la\nwc -l README.md", rules("ls", "wc"), id="newline-list"),
    pytest.param("  ls -la  ", rules("ls"), id="whitespace"),
    pytest.param("ls >/dev/null 2>&1", rules("ls"), id="all-null"),
    pytest.param("make test", rules("=make test"), id="exact-make"),
    pytest.param("python3 -m pytest -q", rules("=python3 -m pytest -q"), id="exact-pytest"),
    pytest.param("find src -type f -name '*.py' -newer README.md", rules("find"), id="find-newer"),
    pytest.param("ls -la\twc", rules("ls"), id="tab"),
    pytest.param("rg -n -e foo -- src", rules("rg"), id="rg-dashdash"),
    pytest.param("ls -- -la", rules("ls"), id="ls-dashdash"),
    pytest.param("date -d tomorrow +%F", rules("date"), id="date-value"),
    pytest.param("date -d -3days +%F", rules("date"), id="date-dash-value"),  # refused for a while (review)
]


@pytest.mark.parametrize("command,rule_set", POSITIVE)
def test_positive_control_plain_commands_are_allowed(command: str, rule_set: tuple[Rule, ...]) -> None:
    v = check_command(command, rule_set)
    assert v.allowed is True, (command, v.reason, v.parse_error)
    assert v.parts and all(p.argv for p in v.parts)


def test_positive_control_dialog_offers_the_expected_prefix() -> None:
    assert check_command("git status --short", []).prefix == "git status"
    assert check_command("ls -la src", []).prefix == "ls"
    assert check_command("grep -rn 'foo bar' src", []).prefix == "grep"
    assert check_command("find . -name '*.py'", []).prefix == "find"


def test_no_sandbox_means_no_rule_allows_anything() -> None:
    v = check_command("ls -la", rules("ls"), sandboxed=False)
    assert v.allowed is False and "sandbox" in v.reason


@pytest.mark.parametrize(
    "command",
    [
        pytest.param("ls " + "a " * 500_000, id="1MB-of-words"),
        pytest.param("ls " + "x" * 5000, id="5000-char-word"),
        pytest.param("echo '" + "a" * 100_000 + "'", id="100k-quoted"),
        pytest.param("(" * 50_000 + "ls" + ")" * 50_000, id="50k-parens"),
        pytest.param("$(" * 50_000 + "ls" + ")" * 50_000, id="50k-cmdsubs"),
    ],
)
def test_oversized_input_fails_closed_quickly_with_a_clear_message(command: str) -> None:
    t0 = time.monotonic()
    v = check_command(command, rules("ls", "echo"))
    assert time.monotonic() - t0 < 3.0
    assert v.allowed is False
    assert v.reason and len(v.reason) < 500, v.reason[:500]  # a message, not the megabyte echoed back
    assert any(w in v.reason.lower() for w in ("long", "characters", "size", "limit")), v.reason


# Deep nesting kept under any plausible size bound, so the grammar walk itself is exercised.
DEEP = [
    pytest.param("(" * 1300 + "ls" + ")" * 1300, False, id="parens"),
    pytest.param("$(" * 1000 + "ls" + ")" * 1000, False, id="cmdsubs"),
    pytest.param("{ " * 800 + "ls; " + "}; " * 799 + "}", False, id="groups"),
    pytest.param("echo " + '"$(' * 600 + "ls" + ')"' * 600, False, id="quoted-cmdsubs"),
    pytest.param("ls " + "<(" * 1000 + "ls" + ")" * 1000, False, id="procsubs"),
    pytest.param("echo $((" + "(" * 1500 + "1" + ")" * 1500 + "))", False, id="arith"),
    pytest.param("echo " + "${x:-" * 600 + "a" + "}" * 600, False, id="param-defaults"),
    pytest.param("if true; then " * 150 + "ls" + "; fi" * 150, False, id="ifs"),
    pytest.param(" && ".join(["ls"] * 650), True, id="long-and-chain"),
    pytest.param(" | ".join(["ls"] * 800), True, id="long-pipeline"),
    pytest.param("; ".join(["ls"] * 1000), True, id="long-list"),
]


@pytest.mark.parametrize("command,plain", DEEP)
def test_deep_nesting_fails_closed_quickly_without_crashing(command: str, plain: bool) -> None:
    assert len(command) <= 4096
    t0 = time.monotonic()
    v = check_command(command, rules("ls", "echo", "true"))  # must not raise (RecursionError, ...)
    assert time.monotonic() - t0 < 3.0
    assert v.reason
    if not plain:
        assert v.allowed is False, v.reason


def test_a_refused_rule_is_quoted_as_typed() -> None:
    """A refusal quoted the rule with Python's escapes (`'ls \\'a b\\' "c"'`, walkthrough): as typed, in
    backticks; a rule holding characters that do not print keeps the escapes, so they show."""
    with pytest.raises(ValueError, match=r"^`ls 'a b' \"c\" <x>` is not a plain command"):
        validate_rule("prefix", "ls 'a b' \"c\" <x>")
    with pytest.raises(ValueError, match=r"^'ls\\x1b\[2K' is not a plain command"):
        validate_rule("exact", "ls\x1b[2K")
