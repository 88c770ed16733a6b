/*
 * dsec-spawn SOCKET_FD: start the edge's child processes from a process with a small fd table.
 *
 * Every fork+exec copies the parent's file descriptor table and then closes all of it (Python's
 * close_fds, or close-on-exec at execve): O(open fds) in the kernel per spawn, for each fd a
 * filp_close with its dnotify and POSIX lock checks. An edge holding 8,000 sandboxes holds
 * ~16,000 fds (two pipes per session shell), and paid ~8 ms per create in this alone (perf: 3
 * spawns per create). This helper is started by the edge while its table is small, receives
 * spawn requests on a SOCK_SEQPACKET socket and forks with CLONE_PARENT: the new process is the
 * EDGE's child (the edge waits for it, gets its exit status and SIGCHLD, and its
 * PR_SET_PDEATHSIG follows the edge), only the fork is done from here.
 *
 * Request (one datagram): NUL-terminated fields
 *     FLAGS CWD EXE ARGC ARG... ENVC ENV... NFDS TARGET...
 * FLAGS is decimal (1: setsid in the child); CWD empty for none; EXE an absolute path; the
 * message carries NFDS descriptors (SCM_RIGHTS) which the child gets at the TARGET numbers, in
 * order; nothing else stays open in it.
 * Reply: "PID ERRNO STAGE" (text): PID of the child (which the edge must reap, also after a
 * failure), ERRNO 0 once the child has exec'd, else errno of the failed STAGE (1 chdir, 2
 * exec, 3 setting up fds or the session), after which the child exits 127.
 *
 * FLAGS 2 (adopt): the child is this helper's, not the edge's. The message then carries one
 * more descriptor after the NFDS ones, a pipe's write end, and the reply carries the child's
 * pidfd (SCM_RIGHTS): once the child has exited, its raw wait status is written to the pipe
 * ("STATUS\n") and the pipe closed. For launchers that leave processes behind (crun and runsc
 * run --detach leave the sandbox's init and their own intermediates): this helper is a child
 * subreaper, so what they leave is reparented here and reaped here, not by the host's init
 * (whose cost per child is the host's: one such init was seen spending half a CPU on 2,000
 * children), and not by the edge, whose waits are all for its own children.
 *
 * The helper dies with the edge (PR_SET_PDEATHSIG) and exits when the socket is closed; what it
 * adopted then goes to the host's init, as before.
 * Build (Debian 12): gcc -static -O2 -Wall -Wextra -Werror -o dsec-spawn dsec_spawn.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_MSG (1 << 20) /* argv + environment of one spawn */
#define MAX_FDS 64
#define MAX_ARGS 8192

#define ADOPT 2

static char msg[MAX_MSG + 1];
static sigset_t unblocked; /* the mask children get back before exec */

/* Adopted launches not yet reaped: their pid and the pipe their status goes to. */
static struct launch {
	pid_t pid;
	int status_fd;
} *launches;
static size_t nlaunches, cap_launches;
static char *argv_buf[MAX_ARGS + 1];
static char *envp_buf[MAX_ARGS + 1];

struct request {
	int flags;
	const char *cwd, *exe;
	char **argv, **envp;
	int nfds, fds[MAX_FDS], targets[MAX_FDS];
};

/* The next NUL-terminated field of msg[0..len) at *pos, or NULL past the end. */
static char *field(size_t len, size_t *pos) {
	if (*pos >= len)
		return NULL;
	char *s = msg + *pos;
	size_t n = strnlen(s, len - *pos);
	if (*pos + n >= len)
		return NULL; /* unterminated */
	*pos += n + 1;
	return s;
}

static int number(size_t len, size_t *pos, long max, long *out) {
	char *s = field(len, pos), *end;
	if (!s || !*s)
		return -1;
	errno = 0;
	long v = strtol(s, &end, 10);
	if (errno || *end || v < 0 || v > max)
		return -1;
	*out = v;
	return 0;
}

static int strings(size_t len, size_t *pos, char **out) {
	long n;
	if (number(len, pos, MAX_ARGS, &n) < 0)
		return -1;
	for (long i = 0; i < n; i++)
		if (!(out[i] = field(len, pos)))
			return -1;
	out[n] = NULL;
	return 0;
}

static int parse(size_t len, struct request *r) {
	size_t pos = 0;
	long v;
	if (number(len, &pos, 3, &v) < 0)
		return -1;
	r->flags = (int)v;
	if ((r->flags & ADOPT) && r->nfds-- < 1)
		return -1; /* the status pipe is missing */
	if (!(r->cwd = field(len, &pos)) || !(r->exe = field(len, &pos)) || r->exe[0] != '/')
		return -1;
	r->argv = argv_buf;
	r->envp = envp_buf;
	if (strings(len, &pos, r->argv) < 0 || !r->argv[0] || strings(len, &pos, r->envp) < 0)
		return -1;
	if (number(len, &pos, MAX_FDS, &v) < 0 || v != r->nfds)
		return -1;
	for (int i = 0; i < r->nfds; i++) {
		if (number(len, &pos, 1 << 20, &v) < 0)
			return -1;
		r->targets[i] = (int)v;
	}
	return pos == len ? 0 : -1;
}

static void child_fail(int errfd, int stage) {
	int e[2] = { stage, errno };
	(void)!write(errfd, e, sizeof e);
	_exit(127);
}

/* In the forked child: descriptors to their targets, everything else closed, then exec. */
static void child(const struct request *r, int errfd) {
	int top = errfd, moved[MAX_FDS];
	for (int i = 0; i < r->nfds; i++)
		if (r->targets[i] > top)
			top = r->targets[i];
	/* Out of the way first, so that no target overwrites a source still to be placed. */
	for (int i = 0; i < r->nfds; i++)
		if ((moved[i] = fcntl(r->fds[i], F_DUPFD_CLOEXEC, top + 1)) < 0)
			child_fail(errfd, 3);
	if ((errfd = fcntl(errfd, F_DUPFD_CLOEXEC, top + 1 + r->nfds)) < 0)
		child_fail(errfd, 3);
	for (int i = 0; i < r->nfds; i++)
		if (dup2(moved[i], r->targets[i]) < 0) /* dup2 clears close-on-exec */
			child_fail(errfd, 3);
	/* Everything else goes, a range at a time (targets may be the edge's fd numbers, in the
	 * tens of thousands: one close(2) per number was milliseconds). */
	for (int lo = 0; lo < errfd;) {
		int next = errfd; /* the lowest kept fd at or above lo */
		for (int i = 0; i < r->nfds; i++)
			if (r->targets[i] >= lo && r->targets[i] < next)
				next = r->targets[i];
		if (next > lo && syscall(SYS_close_range, (unsigned)lo, (unsigned)next - 1, 0) < 0)
			child_fail(errfd, 3);
		lo = next + 1;
	}
	if (syscall(SYS_close_range, (unsigned)errfd + 1, ~0U, 0) < 0)
		child_fail(errfd, 3);
	if ((r->flags & 1) && setsid() < 0)
		child_fail(errfd, 3);
	if (sigprocmask(SIG_SETMASK, &unblocked, NULL) < 0 || signal(SIGPIPE, SIG_DFL) == SIG_ERR)
		child_fail(errfd, 3);
	if (r->cwd[0] && chdir(r->cwd) < 0)
		child_fail(errfd, 1);
	execve(r->exe, r->argv, r->envp);
	child_fail(errfd, 2);
}

static void reply_fd(int sock, long pid, int err, int stage, int fd) {
	char out[64];
	int n = snprintf(out, sizeof out, "%ld %d %d", pid, err, stage);
	struct iovec iov = { out, (size_t)n };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} control;
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
	if (fd >= 0) {
		mh.msg_control = control.buf;
		mh.msg_controllen = sizeof control.buf;
		struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(c), &fd, sizeof(int));
	}
	if (sendmsg(sock, &mh, MSG_NOSIGNAL) < 0)
		_exit(1);
}

static void reply(int sock, long pid, int err, int stage) {
	reply_fd(sock, pid, err, stage, -1);
}

/* Remember an adopted launch: its status goes to a copy of status_fd once it is reaped. */
static int remember(pid_t pid, int status_fd) {
	if (nlaunches == cap_launches) {
		size_t cap = cap_launches ? 2 * cap_launches : 64;
		struct launch *grown = realloc(launches, cap * sizeof *grown);
		if (!grown)
			return -1;
		launches = grown;
		cap_launches = cap;
	}
	int fd = fcntl(status_fd, F_DUPFD_CLOEXEC, 3);
	if (fd < 0)
		return -1;
	launches[nlaunches++] = (struct launch){ pid, fd };
	return 0;
}

/* Reap every exited child: adopted launches report their status, the rest (what launchers
 * left behind and this helper adopted) just go. */
static void reap(void) {
	int status;
	pid_t pid;
	while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
		for (size_t i = 0; i < nlaunches; i++) {
			if (launches[i].pid != pid)
				continue;
			dprintf(launches[i].status_fd, "%d\n", status); /* a pipe: room for one line */
			close(launches[i].status_fd);
			launches[i] = launches[--nlaunches];
			break;
		}
	}
}

static void serve(int sock, size_t len, int *fds, int nfds) {
	struct request r = { .nfds = nfds };
	memcpy(r.fds, fds, sizeof(int) * (size_t)nfds);
	if (parse(len, &r) < 0) {
		reply(sock, -1, EINVAL, 0);
		return;
	}
	int pipefd[2];
	if (pipe2(pipefd, O_CLOEXEC) < 0) {
		reply(sock, -1, errno, 0);
		return;
	}
	/* fork, but the child's parent is ours (the edge): it reaps it and gets its SIGCHLD.
	 * Adopted launches are this helper's own children. */
	int adopt = r.flags & ADOPT;
	long pid = syscall(SYS_clone, (adopt ? 0 : CLONE_PARENT) | SIGCHLD, 0, NULL, NULL, 0);
	if (pid == 0) {
		close(pipefd[0]);
		child(&r, pipefd[1]);
	}
	int saved = errno;
	close(pipefd[1]);
	if (pid < 0) {
		close(pipefd[0]);
		reply(sock, -1, saved, 0);
		return;
	}
	int e[2] = { 0, 0 };
	ssize_t got;
	do
		got = read(pipefd[0], e, sizeof e); /* EOF: the exec closed the child's end */
	while (got < 0 && errno == EINTR);
	close(pipefd[0]);
	int err = got == (ssize_t)sizeof e ? (e[1] ? e[1] : EIO) : 0, stage = err ? e[0] : 0;
	if (!adopt) {
		reply(sock, pid, err, stage);
		return;
	}
	/* Not reaped before reap() runs, so the pidfd is this child's (it may be a zombie). */
	int pidfd = (int)syscall(SYS_pidfd_open, (pid_t)pid, 0);
	if (pidfd < 0 || remember((pid_t)pid, fds[nfds - 1]) < 0) {
		int saved_err = errno;
		kill((pid_t)pid, SIGKILL);
		if (pidfd >= 0)
			close(pidfd);
		reply(sock, -1, saved_err, 0); /* reaped by reap(), unreported */
		return;
	}
	reply_fd(sock, pid, err, stage, pidfd);
	close(pidfd);
}

int main(int argc, char **argv) {
	if (argc != 2) {
		fprintf(stderr, "usage: dsec-spawn SOCKET_FD\n");
		return 2;
	}
	int sock = atoi(argv[1]);
	pid_t edge = getppid();
	if (prctl(PR_SET_PDEATHSIG, SIGKILL) < 0 || getppid() != edge)
		return 1; /* the edge is already gone */
	/* A status pipe whose reader is gone must not end the helper (children get SIG_DFL back). */
	if (prctl(PR_SET_CHILD_SUBREAPER, 1) < 0 || signal(SIGPIPE, SIG_IGN) == SIG_ERR)
		return 1;
	sigset_t chld;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	if (sigprocmask(SIG_BLOCK, &chld, &unblocked) < 0)
		return 1;
	int sfd = signalfd(-1, &chld, SFD_CLOEXEC);
	if (sfd < 0)
		return 1;
	for (;;) {
		struct pollfd ready[2] = { { sock, POLLIN, 0 }, { sfd, POLLIN, 0 } };
		if (poll(ready, 2, -1) < 0 && errno != EINTR)
			return 1;
		if (ready[1].revents & POLLIN) {
			struct signalfd_siginfo info;
			while (read(sfd, &info, sizeof info) < 0 && errno == EINTR)
				;
			reap(); /* signals merge: one read, then every exited child */
		}
		if (!(ready[0].revents & (POLLIN | POLLHUP | POLLERR)))
			continue;
		union {
			char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
			struct cmsghdr align;
		} control;
		struct iovec iov = { msg, MAX_MSG };
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
				     .msg_controllen = sizeof control.buf };
		ssize_t len = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
		if (len < 0 && errno == EINTR)
			continue;
		if (len <= 0)
			return len == 0 ? 0 : 1; /* the edge closed its end (or died) */
		int fds[MAX_FDS], nfds = 0;
		for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
			if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
				continue;
			int n = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
			for (int i = 0; i < n && nfds < MAX_FDS; i++)
				memcpy(&fds[nfds++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
		}
		if (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
			reply(sock, -1, E2BIG, 0);
		else
			serve(sock, (size_t)len, fds, nfds);
		for (int i = 0; i < nfds; i++)
			close(fds[i]);
	}
}
